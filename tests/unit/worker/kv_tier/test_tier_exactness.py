"""Blocks restored from the host tier give the logits of a full recomputation (fp32, the
tolerance of test_engine_exactness), with a partial last block computed; a block restored
into the wrong slot fails that same check (the parity test can fail)."""

from __future__ import annotations

import numpy as np

from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import prompt, request
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    evict_then_ask_again,
    parity_error,
    restored_blocks,
    tier_engine,
)


def test_restored_prefix_with_a_partial_last_block_equals_recompute(model_dir) -> None:
    engine, rec, tier, store = tier_engine(model_dir)
    base = prompt(22, seed=11)  # 5 full blocks of 4 + 2 tokens
    again = request(base + prompt(3, seed=12), max_tokens=4)
    results = evict_then_ask_again(engine, tier, base, again)
    usage = results[(again.request_id, 0)].last.usage
    assert usage.cached_prompt_tokens == 20  # the 5 full blocks; the 2-token tail travelled not
    assert restored_blocks(rec, again.request_id) == 5
    assert tier.stats.restores == 5 and tier.stats.failed_restores == 0
    assert parity_error(model_dir, rec, again, results) <= 1
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    store.check_invariants()


def test_the_last_prompt_token_is_computed_even_when_every_block_is_in_the_tier(
        tiny_llama_dir) -> None:
    engine, rec, tier, _ = tier_engine(tiny_llama_dir)
    base = prompt(24, seed=13)  # 6 full blocks: at most (24 - 1) // 4 = 5 are reused
    again = request(base, max_tokens=3)
    results = evict_then_ask_again(engine, tier, base, again)
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    first = next(c for p in rec.plans for c in p.chunks if c.seq_id == f"{again.request_id}#0")
    assert first.num_computed_tokens == 20 and len(first.token_ids) == 4
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1


class _SwappedRuns(HostTierStore):
    """A tier that puts a run's second block into its first block's slot too. (Reversing a
    run would not do: attention sums over key/value pairs, whose order does not matter.)"""

    def get(self, rank, hashes):
        run = super().get(rank, hashes)
        if run is not None and len(run) > 1:
            run = np.concatenate([run[1:2], run[1:]])
        return run


def test_negative_control_blocks_restored_into_the_wrong_slots_fail_parity(tiny_llama_dir) -> None:
    engine, rec, tier, _ = tier_engine(tiny_llama_dir, _SwappedRuns(TIER_BYTES))
    base = prompt(22, seed=14)
    again = request(base + prompt(3, seed=15), max_tokens=3)
    results = evict_then_ask_again(engine, tier, base, again)
    assert restored_blocks(rec, again.request_id) == 5
    assert parity_error(tiny_llama_dir, rec, again, results) > 1
