"""An export for a peer takes no block that admission counts as free: it is snapshotted when
asked (as a drain's hand-over is), never referenced until a later step. A running request
whose growth admission promised (``reserve``) or that fits beside the cached blocks
(``watermark``) then grows into evicted cached blocks as if no peer had asked."""

from __future__ import annotations

import pytest

from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.kv_tier.tier_harness import POOL_BLOCKS, chain_of, tier_engine


@pytest.mark.parametrize("policy", ["reserve", "watermark"])
def test_an_export_between_steps_leaves_admitted_work_its_blocks(tiny_llama_dir, policy) -> None:
    engine, _, tier, store = tier_engine(tiny_llama_dir, policy=policy)
    base = request(prompt(24, seed=70), max_tokens=1)  # 6 full blocks, cached once it ends
    run(engine, [base])
    chain = chain_of(engine, base)
    assert all(engine.kv.pool.lookup(h) is not None for h in chain) and len(chain) == 6
    # 24 prompt tokens + 8: 8 blocks of the 12. Its prompt takes the 6 free ones; its next
    # token needs a 7th: one of the base's cached (evictable) blocks.
    local = request(prompt(24, seed=71), max_tokens=8)
    answers: list[tuple[bytes, ...]] = []
    running = []

    def export_after_prefill(k: int, eng) -> None:
        if k == 1:  # between its prompt's step and its first decode
            running.extend(eng.scheduler.running)
            assert eng.kv.pool.num_free == eng.kv.pool.num_evictable  # the free list is empty
            assert eng.export_blocks(chain, answers.append) == 6

    # Before exports were snapshotted at once, the next step found the cached blocks
    # referenced: reserve raised AssertionError (every stream of the replica ended INTERNAL),
    # watermark preempted the local request for the peer's pull.
    results = run(engine, [local], on_step=export_after_prefill)
    assert [s.request_id for s in running] == [local.request_id]
    assert running[0].num_preemptions == 0
    assert len(results[(local.request_id, 0)].token_ids) == 8
    assert answers == [tuple(chain)]
    assert tier.flush() and store.lookup(chain, [0]) == 6
    assert engine.kv.num_free_blocks == POOL_BLOCKS
