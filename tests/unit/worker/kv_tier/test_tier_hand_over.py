"""Drain hand-over (issue 26 §3, to the node tier): a draining replica writes its hottest
cached blocks back to the node's tier; another replica of the node then restores them, and
its logits equal recomputation. Through the engine thread, as a drain calls it."""

from __future__ import annotations

import asyncio

from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.service.engine_loop import EngineLoop
from tests.unit.worker.engine_harness import make_engine, prompt, request, run
from tests.unit.worker.kv_tier.tier_harness import (
    POOL_BLOCKS,
    TIER_BYTES,
    chain_of,
    parity_error,
    restored_blocks,
    tier_engine,
)


def test_a_drained_replicas_blocks_are_restored_by_a_survivor(tiny_llama_dir) -> None:
    store = HostTierStore(TIER_BYTES)
    draining, _, _, _ = tier_engine(tiny_llama_dir, store)
    base = prompt(22, seed=41)
    run(draining, [request(base, max_tokens=2)])  # 5 full prompt blocks cached, nothing evicted
    assert store.stats().blocks == 0

    async def drain() -> int:
        loop = EngineLoop(draining, asyncio.get_running_loop())
        loop.start()
        try:
            return await loop.hand_over(max_blocks=100, timeout_s=10.0)
        finally:
            loop.stop()

    handed = asyncio.run(drain())
    assert handed == len(draining.kv.cached_hashes()) >= 5
    assert store.stats().blocks == handed
    survivor, rec, tier, _ = tier_engine(tiny_llama_dir, store)
    again = request(base + prompt(3, seed=42), max_tokens=3)
    results = run(survivor, [again])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert restored_blocks(rec, again.request_id) == 5
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1


def test_the_hand_over_is_bounded_and_hottest_first(tiny_llama_dir) -> None:
    store = HostTierStore(TIER_BYTES)
    engine, _, _, _ = tier_engine(tiny_llama_dir, store)
    old, new = prompt(9, seed=43), prompt(9, seed=44)
    run(engine, [request(old, max_tokens=1)])
    run(engine, [request(new, max_tokens=1)])  # released last: the hottest
    hot = engine.kv.pool.hot_blocks()
    newest = request(new, max_tokens=1)
    assert {h for _, h in hot[:2]} == set(chain_of(engine, newest))  # the newer prompt's 2 blocks
    assert engine.hand_over(2) == 2
    assert store.lookup([h for _, h in hot[:2]], [0]) == 2
    assert store.stats().blocks == 2 and hot[0][1] in engine.kv.cached_hashes()
    # Without a tier there is nothing to hand over.
    plain, _ = make_engine(tiny_llama_dir, num_blocks=POOL_BLOCKS)
    assert plain.hand_over(10) == 0


def test_a_hand_over_past_the_write_back_queue_lands_whole(tiny_llama_dir) -> None:
    """A pool larger than the write-back queue is handed over in turns (each queued, then
    waited for), not dropped whole; the count is what the tier got."""
    store = HostTierStore(TIER_BYTES)
    engine, _, tier, _ = tier_engine(tiny_llama_dir, store)
    run(engine, [request(prompt(9, seed=45), max_tokens=1)])
    run(engine, [request(prompt(9, seed=46), max_tokens=1)])
    hot = engine.kv.pool.hot_blocks()
    assert len(hot) == 4
    tier.max_pending_bytes = tier.max_run_bytes = _block_bytes(tier)  # one block at a time
    assert engine.hand_over(4) == 4
    assert store.lookup([h for _, h in hot], [0]) == 4


def test_a_hand_over_counts_what_landed_not_what_was_asked(tiny_llama_dir) -> None:
    class _Refusing(HostTierStore):
        def put(self, rank, hashes, run, tag=b""):
            raise TimeoutError("the tier did not answer")

    store = _Refusing(TIER_BYTES)
    engine, _, _, _ = tier_engine(tiny_llama_dir, store)
    run(engine, [request(prompt(9, seed=47), max_tokens=1)])
    assert engine.hand_over(2) == 0 and store.stats().blocks == 0


def _block_bytes(tier) -> int:
    import numpy as np

    return int(np.prod(tier.block_shape))
