"""The host tier over layer groups (window-sized KV): each group's pages are written back under
their own keys and restored by the per-group hit rule — a full group's pages up to the hit, a
sliding group's only those covering the window before it — and the logits equal transformers'
full recomputation, at tp=1 and tp=2. A windowed layout's pages never serve a replica of
another layout (the tier's shard names the layout). A fresh replica pre-warmed with a drained
one's pages serves the prefix from its device pool by the same rule.

Models (block size 4): Gemma 3 with window 7 (not a multiple of the block; 6 layers, full every
3rd: one full group and two sliding ones of 2 layers each) and Mistral with window 6 (one
sliding group of every layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.allocator.kv_bytes import kv_heads_per_rank
from kvfleet.allocator.kv_cache_manager import NULL_BLOCK
from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.kv_tier.tier_layout import LayoutTier, TierLayout
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.fixtures.models import GEMMA3_SHAPE, write_windowed_model
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request, run
from tests.unit.worker.executor.tp.thread_executor import thread_executor
from tests.unit.worker.kv_tier.tier_harness import TIER_BYTES, chain_of, parity_error, tier_engine

MODELS = {
    "gemma3-w7": ("gemma3_text", dict(GEMMA3_SHAPE, sliding_window=7, num_hidden_layers=6,
                                      sliding_window_pattern=3)),
    "mistral-w6": ("mistral", dict(sliding_window=6)),
}
CHUNK = 16


def _pool(groups: LayerGroups) -> int:
    """Pages such that two 40-token fillers (16-token chunks) evict every page a 22-token
    base left in the pool."""
    return 40 if groups.num_groups > 1 else 12


@pytest.fixture(scope="module", params=list(MODELS))
def windowed(request, tmp_path_factory, smollm2_dir) -> tuple[Path, LayerGroups]:
    family, shape = MODELS[request.param]
    return write_windowed_model(tmp_path_factory.mktemp(request.param), family, smollm2_dir,
                                seed=12, **shape)


def _layout(model_dir: Path, groups: LayerGroups, tp: int) -> TierLayout:
    mc = load_model_config(model_dir)
    return TierLayout(tp, kv_heads_per_rank(mc.num_kv_heads, mc.num_heads, tp), groups.layout_key)


def _restored_pages(rec, rid: str) -> dict[int, int]:
    """Pages the plan of request ``rid``'s first chunk restored for it, by layer group (that
    chunk's tables)."""
    at, chunk = next((i, c) for i, p in enumerate(rec.plans) for c in p.chunks
                     if c.seq_id == f"{rid}#0")
    by_block = {b: g for g, table in enumerate(chunk.tables()) for b in table if b != NULL_BLOCK}
    out: dict[int, int] = {}
    for p in rec.plans[at:at + 1]:
        for b, _ in p.block_restores:
            if b in by_block:
                out[by_block[b]] = out.get(by_block[b], 0) + 1
    return out


def _evict_then_ask_again(engine, tiers, base: list[int], again):
    """Run ``base``, then fillers that push every page it left out of the pool (written back),
    wait for the write-backs, then run ``again``."""
    run(engine, [request(base, max_tokens=2)])
    for seed in (90, 91):
        run(engine, [request(prompt(40, seed=seed), max_tokens=2)])
    kv = engine.kv
    chain = chain_of(engine, request(base))
    assert all(kv.pool.lookup(kv.key(g, h)) is None for g in range(kv.num_groups)
               for h in chain), "not evicted"
    for t in tiers:
        assert t.flush(), "write-backs did not finish"
    return run(engine, [again])


def _expected_pages(groups: LayerGroups, hit_blocks: int, first: int = 0) -> dict[int, int]:
    """Per group, the pages a hit of ``hit_blocks`` blocks restores after the ``first`` the
    device holds: every block for a full group, those the query at the hit sees for a
    sliding one."""
    n = hit_blocks * BLOCK_SIZE
    return {g: hit_blocks - first if w is None
            else hit_blocks - max(first, max(0, n - w + 1) // BLOCK_SIZE)
            for g, w in enumerate(groups.windows)}


def _check(model_dir, groups, engine, rec, tiers, store) -> None:
    base = prompt(22, seed=11)  # 5 full blocks of 4 + 2 tokens
    again = request(base + prompt(3, seed=12), max_tokens=5)
    results = _evict_then_ask_again(engine, tiers, base, again)
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    pages = _restored_pages(rec, again.request_id)
    assert pages == _expected_pages(groups, 5)
    assert sum(pages.values()) < 5 * groups.num_groups or groups.num_groups == 1
    assert parity_error(model_dir, rec, again, results) <= 1
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    store.check_invariants()


def _grouped_engine(model_dir: Path, groups: LayerGroups, store: HostTierStore):
    """(engine, recorder, rank tier, layout tier): tp=1 over ``groups``, writing back to
    ``store`` under the grouped layout."""
    tier = LayoutTier(store, _layout(model_dir, groups, 1))
    runner = ModelRunner(model_dir, num_blocks=_pool(groups), block_size=BLOCK_SIZE,
                         layer_groups=groups)
    engine, rec, rank_tier, _ = tier_engine(model_dir, tier, runner=runner,
                                            num_blocks=_pool(groups), max_num_batched_tokens=CHUNK)
    return engine, rec, rank_tier, tier


def test_restored_group_pages_equal_recompute(windowed) -> None:
    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    engine, rec, rank_tier, _ = _grouped_engine(model_dir, groups, store)
    _check(model_dir, groups, engine, rec, [rank_tier], store)
    assert rank_tier.stats.failed_restores == 0


def test_a_device_hit_extended_from_the_tier_equals_recompute(windowed) -> None:
    """The device holds the head of the chain (the full group's first blocks, a sliding
    group's window before them: restored for an earlier request), the tier the rest: the
    restore starts after the device hit, takes each group's pages by the rule, releases the
    device's sliding pages the longer hit's window no longer reaches, and the logits equal
    transformers'."""
    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    engine, rec, rank_tier, _ = _grouped_engine(model_dir, groups, store)
    base = prompt(22, seed=21)
    mid = request(base[:13] + prompt(3, seed=22), max_tokens=2)  # reuses blocks 0..2
    again = request(base + prompt(3, seed=23), max_tokens=3)
    _evict_then_ask_again(engine, [rank_tier], base, mid)
    assert _restored_pages(rec, mid.request_id) == _expected_pages(groups, 3)
    results = run(engine, [again])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert _restored_pages(rec, again.request_id) == _expected_pages(groups, 5, first=3)
    assert parity_error(model_dir, rec, again, results) <= 1
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_restored_group_pages_equal_recompute_at_tp2(windowed, monkeypatch) -> None:
    """Each rank writes back and restores its KV-head shard of every group's pages."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    tier = LayoutTier(store, _layout(model_dir, groups, 2))
    with thread_executor(model_dir, 2, num_blocks=_pool(groups), tier=tier, layer_groups=groups) as ex:
        engine, rec, rank_tier, _ = tier_engine(model_dir, tier, executor=ex, tp=2,
                                                num_blocks=_pool(groups), max_num_batched_tokens=CHUNK)
        rank1 = ex.group.workers[0].tier
        _check(model_dir, groups, engine, rec, [rank_tier, rank1], store)
        assert rank_tier.stats.restores == rank1.stats.restores == sum(
            _expected_pages(groups, 5).values())
    assert {k[1] for k in store._blocks} == {tier.layout.shard(0), tier.layout.shard(1)}


def test_a_windowed_layouts_pages_never_serve_another_layout(windowed) -> None:
    """The same model without layer groups (one page of every layer) on the same node tier:
    the windowed replica's pages are not its blocks (another shard), so it recomputes — with
    the logits of full recomputation — and its own write-backs do not mix with them."""
    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    engine, _, rank_tier, grouped = _grouped_engine(model_dir, groups, store)
    base = prompt(22, seed=13)
    _evict_then_ask_again(engine, [rank_tier], base, request(prompt(6, seed=14), max_tokens=1))
    assert store.lookup(chain_of(engine, request(base))[:5], [grouped.layout.shard(0)]) == 5

    plain = LayoutTier(store, TierLayout(grouped.layout.tp, grouped.layout.kv_heads))
    flat_runner = ModelRunner(model_dir, num_blocks=_pool(groups), block_size=BLOCK_SIZE)
    other, rec, _, _ = tier_engine(model_dir, plain, runner=flat_runner, num_blocks=_pool(groups))
    again = request(base + prompt(3, seed=15), max_tokens=3)
    results = run(other, [again])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert not any(p.block_restores for p in rec.plans)
    assert parity_error(model_dir, rec, again, results) <= 1


def test_a_pulled_windowed_prefix_equals_recompute(windowed) -> None:
    """Replica A (same layout, same node tier) exports every group's pages of the prefix it
    holds; B restores the full group's pages and the sliding groups' window, never computes
    them, and its logits equal transformers'."""
    import asyncio

    from tests.unit.worker.kv_tier.peer_harness import LoopPeer, hint, puller, with_loop

    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    a, _, a_tier, _ = _grouped_engine(model_dir, groups, store)
    base = prompt(22, seed=16)
    run(a, [request(base, max_tokens=2)])
    assert store.stats().blocks == 0 and a_tier.flush()
    b, rec, b_tier, _ = _grouped_engine(model_dir, groups, store)
    again = request(base + prompt(3, seed=17), max_tokens=4)

    async def pull(loop):
        p = puller(LoopPeer(loop), b)
        return await p.prepare(again, hint(5)), p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert p.stats.pulls == 1 and p.stats.pulled_blocks == 5
    assert a.exports.exported_blocks == 5 and store.stats().blocks >= 5
    a.kv.check_invariants()
    assert a.kv.num_free_blocks == a.kv.num_total_blocks  # the export's references went
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert _restored_pages(rec, again.request_id) == _expected_pages(groups, 5)
    assert parity_error(model_dir, rec, again, results) <= 1
    assert b_tier.stats.failed_restores == 0
    store.check_invariants()


def test_a_drained_windowed_replicas_pages_cross_nodes(windowed) -> None:
    """A grouped replica drains into node X's tier (every group's pages); a survivor on node
    Y pulls through X's tier: the relay copies each group's pages X holds, and the survivor
    restores by the per-group rule with the logits of full recomputation."""
    import asyncio

    from kvfleet.index_keys import tier_id
    from kvfleet.worker.kv_tier.peer_client import TierPeer
    from kvfleet.worker.kv_tier.peer_pull import PeerHint
    from tests.unit.worker.kv_tier.peer_harness import InProcessRelay, puller

    model_dir, groups = windowed
    x_store, y_store = HostTierStore(TIER_BYTES), HostTierStore(TIER_BYTES)
    drained, _, x_tier, x = _grouped_engine(model_dir, groups, x_store)
    base = prompt(22, seed=18)
    run(drained, [request(base, max_tokens=2)])
    assert drained.hand_over(drained.kv.num_total_blocks) >= 5 and x_tier.flush()
    survivor, rec, _, y = _grouped_engine(model_dir, groups, y_store)
    relay = InProcessRelay(y, {"x": x}, num_groups=groups.num_groups)
    p = puller(None, survivor, node="y", relay=relay, tiers=TierPeer(relay.source, [0]))
    again = request(base + prompt(3, seed=19), max_tokens=3)
    pulled = asyncio.run(p.prepare(again, PeerHint("", "", 5, 0, tier_id("x"))))
    assert p.stats.pulls == 1 and p.stats.pulled_blocks == 5
    results = run(survivor, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert _restored_pages(rec, again.request_id) == _expected_pages(groups, 5)
    assert parity_error(model_dir, rec, again, results) <= 1
    x_store.check_invariants()
    y_store.check_invariants()


def test_a_prewarmed_windowed_replica_hits_its_device_pool(windowed) -> None:
    """Replica A drains every group's pages into the node tier; a fresh replica B of the same
    layout pre-warms them: each group's pages land under their own keys, so B's first request
    reuses the whole prefix by the per-group rule from its device pool (nothing restored at
    admission), with the logits of full recomputation; B's pool leaks nothing."""
    from kvfleet.worker.kv_tier.prewarm import prewarm

    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    a, _, a_tier, _ = _grouped_engine(model_dir, groups, store)
    base = prompt(22, seed=24)
    run(a, [request(base, max_tokens=2)])
    pages = len(a.kv.pool.cached_hashes())
    assert a.hand_over(a.kv.num_total_blocks) == pages and a_tier.flush()

    b, rec, b_tier, _ = _grouped_engine(model_dir, groups, store)
    again = request(base + prompt(3, seed=25), max_tokens=3)
    assert prewarm(b, seconds=30.0, run_blocks=4) == pages
    chain = chain_of(b, again)[:5]
    assert all(b.kv.pool.lookup(b.kv.key(g, h)) is not None
               for g in range(groups.num_groups) for h in chain)
    b.kv.check_invariants()
    assert b.kv.num_free_blocks == b.kv.num_total_blocks  # cached, all evictable
    assert b_tier.stats.restores == pages and b_tier.stats.failed_restores == 0

    results = run(b, [again])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert not any(p.block_restores for p in rec.plans)  # from the device pool, not the tier
    assert b.stats()["prefix_hits"]["device"] == 20
    assert parity_error(model_dir, rec, again, results) <= 1
    b.kv.check_invariants()
    assert b.kv.num_free_blocks == b.kv.num_total_blocks
    store.check_invariants()


def test_a_windowed_prewarm_whose_restore_fails_keeps_nothing(windowed) -> None:
    """The tier answered hottest and held, then lost the pages before the restore: the first
    run fails, and no page stays registered or referenced."""
    from kvfleet.worker.kv_tier.prewarm import prewarm

    model_dir, groups = windowed
    store = HostTierStore(TIER_BYTES)
    a, _, a_tier, _ = _grouped_engine(model_dir, groups, store)
    run(a, [request(prompt(22, seed=26), max_tokens=2)])
    assert a.hand_over(a.kv.num_total_blocks) >= 5 and a_tier.flush()

    b, _, b_tier, _ = _grouped_engine(model_dir, groups, store)
    lookup = b.scheduler.tier.lookup
    hot = lookup.store.hottest(b.identity_digest, lookup.ranks, 100)
    lookup.store = _Answered(lookup.store, hot)
    store.clear()
    assert prewarm(b, seconds=30.0) == 0
    assert b_tier.stats.failed_restores == 1  # the first run was tried, the rest not
    b.kv.check_invariants()
    assert b.kv.pool.cached_hashes() == set()
    assert b.kv.num_free_blocks == b.kv.num_total_blocks


class _Answered:
    """A tier whose ``hottest`` and ``held`` answer as before it lost its pages."""

    def __init__(self, store, hot: list[bytes]) -> None:
        self.store, self.hot = store, hot

    def hottest(self, tag, ranks, max_blocks):
        return self.hot[:max_blocks]

    def held(self, keys, ranks):
        return [k in self.hot for k in keys]

    def __getattr__(self, name):
        return getattr(self.store, name)
