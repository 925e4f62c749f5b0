"""Pre-warm of a new replica (issue 26 §3): before serving it restores, into its device pool,
the blocks its node's tier holds for its identity, most recently used first, within a time
bound. Its first request then reuses them from the device pool (nothing restored at
admission) and its logits equal full recomputation."""

from __future__ import annotations

import numpy as np
import pytest

from kvfleet.allocator.kv_cache_manager import group_key
from kvfleet.worker.kv_tier.prewarm import prewarm, prewarm_page_runs, prewarm_runs
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request, run
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    chain_of,
    parity_error,
    restored_blocks,
    tier_engine,
)


def test_the_plan_skips_cached_blocks_and_fits_the_free_pool():
    hot = [bytes([i]) * 16 for i in range(7)]
    cached = {hot[1]}
    runs = prewarm_runs(hot, cached.__contains__, free_blocks=5, run_blocks=2)
    assert runs == [[hot[0], hot[2]], [hot[3], hot[4]], [hot[5]]]
    assert prewarm_runs(hot, cached.__contains__, free_blocks=0) == []
    with pytest.raises(ValueError):
        prewarm_runs(hot, cached.__contains__, 5, run_blocks=0)


def test_the_group_plan_pairs_pages_by_block_and_keeps_blocks_whole():
    """Groups: full, sliding 8, sliding 4. A sliding page comes only with its block's pages of
    every wider group; a block ranks by its hottest page; a block that does not fit ends it."""
    windows = (None, 8, 4)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    k = group_key
    held = {k(0, a), k(1, a), k(2, a),  # whole
            k(0, b), k(2, b),           # group 2's partner in group 1 missing: full page only
            k(1, c), k(2, c),           # no full page: nothing
            k(0, d), k(1, d)}           # group 2 missing: groups 0 and 1
    hottest = [k(2, b), k(0, a), k(1, c), k(1, d)]  # b is hottest (its sliding page)
    cached = {k(1, a)}.__contains__
    present = lambda key: key in held or cached(key)  # noqa: E731
    runs = prewarm_page_runs(hottest, windows, present, cached, free_blocks=10, run_blocks=3)
    assert runs == [[k(0, b), k(0, a), k(2, a)], [k(0, d), k(1, d)]]
    # a's 2 pages would not fit after b's 1 in 2 free pages: the plan stops there.
    assert prewarm_page_runs(hottest, windows, present, cached, free_blocks=2) == [[k(0, b)]]
    # Runs never split a block that fits in one: a's pages start a run of their own.
    assert prewarm_page_runs(hottest, windows, present, cached, 10, run_blocks=2) == [
        [k(0, b)], [k(0, a), k(2, a)], [k(0, d), k(1, d)]]
    with pytest.raises(ValueError):
        prewarm_page_runs(hottest, windows, present, cached, 5, run_blocks=0)


def test_a_prewarmed_replicas_first_request_hits_its_device_pool(tiny_llama_dir) -> None:
    store = HostTierStore(TIER_BYTES)
    old, _, old_tier, _ = tier_engine(tiny_llama_dir, store)
    base = prompt(22, seed=71)  # 5 full blocks of 4
    run(old, [request(base, max_tokens=2)])
    assert old.hand_over(old.kv.num_total_blocks) >= 5 and old_tier.flush()
    # Another model's block (another writer's tag) is never pre-warmed.
    other = b"o" * 16
    store.put(0, [other], np.zeros((1, *old_tier.block_shape), dtype=np.uint8), tag=b"other")

    new, rec, _, _ = tier_engine(tiny_llama_dir, store)
    assert prewarm(new, seconds=0) == 0 and new.kv.cached_hashes() == set()
    again = request(base + prompt(3, seed=72), max_tokens=3)
    order = store.hottest(new.identity_digest, [0], 100)  # restores then change it
    warmed = prewarm(new, seconds=30.0, run_blocks=2)  # 3 restore calls at least
    assert warmed == len(old.kv.cached_hashes())
    assert set(chain_of(new, again)[:5]) <= new.kv.cached_hashes()
    assert other not in new.kv.cached_hashes()
    new.kv.check_invariants()
    assert new.kv.num_free_blocks == new.kv.num_total_blocks  # cached, all evictable
    # The hottest blocks are the last the pool would evict.
    hot = [h for _, h in new.kv.pool.hot_blocks()]
    assert hot[:warmed] == order

    results = run(new, [again])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 5 * BLOCK_SIZE
    assert restored_blocks(rec, again.request_id) == 0  # from the device pool, not the tier
    assert new.stats()["prefix_hits"]["device"] == 5 * BLOCK_SIZE
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1


def test_a_prewarm_is_bounded_in_time_and_stops_at_a_failed_restore(tiny_llama_dir) -> None:
    store = HostTierStore(TIER_BYTES)
    old, _, old_tier, _ = tier_engine(tiny_llama_dir, store)
    run(old, [request(prompt(22, seed=73), max_tokens=2)])
    assert old.hand_over(old.kv.num_total_blocks) >= 5 and old_tier.flush()

    new, _, _, _ = tier_engine(tiny_llama_dir, store)
    ticks = iter([0.0, 0.5, 2.0])  # the deadline (1 s) passes before the second run
    assert prewarm(new, seconds=1.0, run_blocks=2, clock=lambda: next(ticks)) == 2
    assert len(new.kv.cached_hashes()) == 2

    cold, _, _, _ = tier_engine(tiny_llama_dir, store)
    store.clear()  # evicted since the lookup: the first restore fails, nothing is kept
    cold.scheduler.tier.lookup.store = _Frozen(store, old.identity_digest,
                                               sorted(old.kv.cached_hashes()))
    assert prewarm(cold, seconds=10.0) == 0
    cold.kv.check_invariants()
    assert cold.kv.cached_hashes() == set()
    assert cold.kv.num_free_blocks == cold.kv.num_total_blocks


class _Frozen:
    """A tier whose ``hottest`` answers hashes it no longer holds."""

    def __init__(self, store: HostTierStore, tag: bytes, hashes: list[bytes]) -> None:
        self.store, self.tag, self.hashes = store, tag, hashes

    def hottest(self, tag, ranks, max_blocks):
        return self.hashes[:max_blocks] if tag == self.tag else []

    def __getattr__(self, name):
        return getattr(self.store, name)
