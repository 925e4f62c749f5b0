"""Replica-to-replica prefix pulls (issue 26 §2), engine level: replica A exports a prefix it
holds in its device pool through the node's tier (its real engine loop), replica B pulls it on
a hint and restores it like any tier hit. Logits equal full recomputation; a pull whose hashes
differ from B's own chain is refused; a peer that fails or hangs mid-transfer leaves B to
recompute, and nothing leaks on either side."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvfleet.worker.kv_tier.peer_pull import PeerHint
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request, run
from tests.unit.worker.kv_tier.peer_harness import LoopPeer, hint, puller, with_loop
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    chain_of,
    parity_error,
    restored_blocks,
    tier_engine,
)


def _two_replicas(model_dir, base: list[int]):
    """(A, B, B's recorder, the node's store): A has run ``base`` (its full blocks cached in
    A's pool, none in the tier); B is fresh."""
    store = HostTierStore(TIER_BYTES)
    a, _, a_tier, _ = tier_engine(model_dir, store)
    run(a, [request(base, max_tokens=2)])
    assert store.stats().blocks == 0 and a_tier.flush()
    b, rec, b_tier, _ = tier_engine(model_dir, store)
    return a, b, rec, store


def _idle(engine) -> None:
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_a_pulled_prefix_equals_recompute_and_releases_the_exporters_blocks(model_dir) -> None:
    base = prompt(22, seed=51)  # 5 full blocks of 4 + 2 tokens
    a, b, rec, store = _two_replicas(model_dir, base)
    again = request(base + prompt(3, seed=52), max_tokens=4)

    async def pull(loop):
        return await puller(LoopPeer(loop), b).prepare(again, hint(5)), loop

    pulled, _ = asyncio.run(with_loop(a, pull))
    assert not pulled.tier_skip
    assert store.stats().blocks == 5 and a.exports.exported_blocks == 5
    _idle(a)  # the export's references went once the blocks were copied
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert restored_blocks(rec, again.request_id) == 5  # never computed on B
    assert parity_error(model_dir, rec, again, results) <= 1
    _idle(b)
    store.check_invariants()


def test_the_pull_asks_for_the_receivers_missing_blocks_and_stops_at_the_limit(
        tiny_llama_dir) -> None:
    base = prompt(24, seed=53)  # 6 full blocks; the reuse rule allows (24 - 1) // 4 = 5
    a, b, rec, store = _two_replicas(tiny_llama_dir, base)
    again = request(base, max_tokens=2)
    asked: list[tuple[bytes, ...]] = []

    def answer(hashes):
        asked.append(hashes)
        return hashes

    async def pull(loop):
        p = puller(LoopPeer(loop, answer), b)
        return await p.prepare(again, hint(num_blocks=6, first_block=2)), p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert asked == [tuple(chain_of(b, again)[2:5])]  # blocks 2..4: B's own chain
    assert p.stats.pulls == 1 and p.stats.pulled_blocks == 3
    assert store.stats().blocks == 3


def test_a_pull_whose_hashes_differ_from_the_receivers_chain_is_refused(tiny_llama_dir) -> None:
    base = prompt(22, seed=54)
    a, b, rec, store = _two_replicas(tiny_llama_dir, base)
    again = request(base + prompt(3, seed=55), max_tokens=3)

    def lie(hashes):  # the last block claimed under another hash
        return hashes[:-1] + (bytes(16),)

    async def pull(loop):
        p = puller(LoopPeer(loop, lie), b)
        return await p.prepare(again, hint(5)), p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert p.stats.refused == 1 and p.stats.pulls == 0
    assert pulled.tier_skip  # nothing from the tier for it, though its 5 blocks are there
    assert store.lookup(chain_of(b, again)[:5], [0]) == 5
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert restored_blocks(rec, again.request_id) == 0
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(a)
    _idle(b)


class _Unreachable:
    async def export(self, hint, hashes, timeout_s):
        raise ConnectionError("peer unreachable")

    async def close(self) -> None:
        pass


def test_an_unreachable_peer_leaves_the_request_to_recompute(tiny_llama_dir) -> None:
    store = HostTierStore(TIER_BYTES)
    b, rec, _, _ = tier_engine(tiny_llama_dir, store)
    again = request(prompt(22, seed=56), max_tokens=3)
    p = puller(_Unreachable(), b)
    pulled = asyncio.run(p.prepare(again, hint(5)))
    assert p.stats.failed == 1 and pulled == again
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(b)


def test_an_exporter_that_dies_mid_transfer_leaves_the_request_to_recompute(
        tiny_llama_dir) -> None:
    """A's engine thread stops after the export reached its inbox: B's wait ends at its
    timeout, B recomputes; A's referenced blocks go with A."""
    base = prompt(22, seed=57)
    a, b, rec, store = _two_replicas(tiny_llama_dir, base)
    again = request(base + prompt(3, seed=58), max_tokens=3)

    async def pull(loop):
        loop.stop()  # killed: the export is queued but never runs
        p = puller(LoopPeer(loop), b, max_timeout_s=0.3)
        return await p.prepare(again, hint(5)), p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert p.stats.failed == 1 and p.stats.pulls == 0 and not pulled.tier_skip
    assert store.stats().blocks == 0
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(b)


def test_a_hint_is_skipped_when_recomputing_is_cheaper_or_nothing_is_missing(
        tiny_llama_dir) -> None:
    from kvfleet.worker.step_cost.model import ZERO, StepCost

    b, _, _, _ = tier_engine(tiny_llama_dir)
    req = request(prompt(22, seed=59), max_tokens=2)
    p = puller(_Unreachable(), b)
    assert asyncio.run(p.prepare(req, hint(5, first_block=5))) == req  # holds them all
    p.step_cost = StepCost(ZERO)  # recompute predicted free: never worth a pull
    assert asyncio.run(p.prepare(req, hint(5))) == req
    assert p.stats.skipped == 2 and p.stats.failed == 0


def test_a_pull_is_tried_exactly_when_its_predicted_time_beats_the_recompute(
        tiny_llama_dir) -> None:
    """The decision is the pull's predicted time against the recompute's, the same for a
    replica and a node tier: no other wait is priced (a run just worth pulling is tried, one
    just not is skipped)."""
    from kvfleet.worker.step_cost.model import CostModel, StepCost

    b, _, _, _ = tier_engine(tiny_llama_dir)
    p = puller(_Unreachable(), b)
    p.tiers = _Unreachable()
    p.step_cost = StepCost(CostModel(0.0, 0.01, 0.0, "test: 10 ms a token"), alpha=0.0)
    per_block = 0.01 * BLOCK_SIZE  # recompute of one block
    p.cost = dataclasses.replace(p.cost, overhead_s=2.5 * per_block, seconds_per_byte=0.0)
    req = request(prompt(16 * BLOCK_SIZE, seed=61), max_tokens=2)
    for h in (hint(2), PeerHint("", "", 2, tier_id="tier:n")):  # 2 blocks: 0.32 s < 0.4 s
        assert asyncio.run(p.prepare(req, h)) == req
    assert (p.stats.skipped, p.stats.failed) == (2, 0)
    for h in (hint(3), PeerHint("", "", 3, tier_id="tier:n")):  # 3 blocks: 0.48 s > 0.4 s
        asyncio.run(p.prepare(req, h))  # tried (unreachable: recomputed)
    assert (p.stats.skipped, p.stats.failed) == (2, 2)


def test_an_export_whose_transfer_fails_reports_nothing_and_releases_its_blocks(
        tiny_llama_dir) -> None:
    """The exporter's transfer call fails (its tier's actor, a rank): it answers no blocks, its
    blocks are unreferenced again, and the receiver recomputes."""
    base = prompt(22, seed=60)
    a, b, rec, store = _two_replicas(tiny_llama_dir, base)

    def broken(saves, restores):
        raise RuntimeError("tier gone")

    a.executor.transfer_blocks = broken
    again = request(base + prompt(3, seed=61), max_tokens=3)

    async def pull(loop):
        p = puller(LoopPeer(loop), b)
        return await p.prepare(again, hint(5)), p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert (p.stats.pulls, p.stats.empty, p.stats.pulled_blocks) == (0, 1, 0)  # nothing exported
    assert a.exports.exported_blocks == 0 and store.stats().blocks == 0
    _idle(a)
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(b)


def test_an_export_whose_write_back_was_dropped_answers_only_what_landed(tiny_llama_dir) -> None:
    """A's writer drops the snapshot (its queue is full): A answers only the blocks the
    node's tier holds (none), not every block it snapshotted, and B recomputes."""
    base = prompt(22, seed=67)
    a, b, rec, store = _two_replicas(tiny_llama_dir, base)
    a.executor.tier.max_pending_bytes = 0  # every write-back is dropped
    again = request(base + prompt(3, seed=68), max_tokens=3)

    async def pull(loop):
        p = puller(LoopPeer(loop), b)
        return await p.prepare(again, hint(5)), p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert store.stats().blocks == 0
    assert (p.stats.pulls, p.stats.empty, p.stats.pulled_blocks) == (0, 1, 0)
    _idle(a)
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(b)


def test_an_export_is_snapshotted_at_once_and_holds_no_block(tiny_llama_dir) -> None:
    """The export's blocks are copied for write-back when it is asked, not at the next step:
    it is answered at once and references nothing, so a request that needs nearly all of A's
    pool may evict them right away, and the copies in the tier give B the logits of
    recomputation."""
    base = prompt(22, seed=62)
    a, b, rec, store = _two_replicas(tiny_llama_dir, base)
    chain = chain_of(a, request(base))[:5]
    answers: list[tuple[bytes, ...]] = []
    assert a.export_blocks(chain, answers.append) == 5
    assert answers == [tuple(chain)]  # before any step
    blocks = [a.kv.pool.lookup(h) for h in chain]
    assert all(a.kv.ref_count(x) == 0 for x in blocks)  # cached, evictable: nothing holds them
    filler = request(prompt(40, seed=63), max_tokens=2)  # 11 of the pool's 12 blocks
    run(a, [filler])
    assert any(a.kv.pool.lookup(h) is None for h in chain), "none evicted"
    assert a.executor.tier.flush() and store.lookup(chain, [0]) == 5
    again = request(base + prompt(3, seed=64), max_tokens=3)
    results = run(b, [again])
    assert restored_blocks(rec, again.request_id) == 5
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(a)


def test_an_export_stops_at_a_repeated_hash(tiny_llama_dir) -> None:
    """A request naming one cached block more times than the pool has free blocks (no chain
    repeats a hash): the leading run ends at the repeat."""
    base = prompt(22, seed=65)
    a, _, _, store = _two_replicas(tiny_llama_dir, base)
    chain = chain_of(a, request(base))[:2]
    answers: list[tuple[bytes, ...]] = []
    assert a.export_blocks([chain[0], chain[1], chain[0]] * a.kv.num_total_blocks,
                           answers.append) == 2
    run(a, [request(prompt(5, seed=66), max_tokens=1)])
    assert answers == [tuple(chain)]
    assert a.executor.tier.flush() and store.lookup(chain, [0]) == 2
    _idle(a)


def test_a_replica_without_a_host_tier_refuses_to_export(tiny_llama_dir) -> None:
    from kvfleet.errors import FailedPrecondition
    from tests.unit.worker.engine_harness import make_engine

    engine, _ = make_engine(tiny_llama_dir, num_blocks=12)

    async def export(loop):
        with pytest.raises(FailedPrecondition, match="no host KV tier"):
            await loop.export_blocks((bytes(16),), 5.0)

    asyncio.run(with_loop(engine, export))
    _idle(engine)
