"""Layer-level yield beside a host KV tier: the nested step writes back the cached blocks its
allocations evict and restores its tier hits between two layers of the paused step, over the
real tiny runner, against transformers.

The setup fills a small pool so that every free block is a cached one: a prompt's blocks are
pushed out to the tier, then a batch flood runs; an interactive request for that prompt
arrives after the first layer of a mixed batch step (forced, never timed). Its nested step
restores the prompt's blocks from the tier and evicts cached blocks, written back first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine.layer_yield.test_yield_engine import LayerArrivals, drive
from tests.unit.worker.engine_harness import (
    BLOCK_SIZE,
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    seq_tokens,
)
from tests.unit.worker.executor.tp.thread_executor import thread_executor
from tests.unit.worker.kv_tier.tier_harness import TIER_BYTES, chain_of
from tests.unit.worker.paged_driver import runner_for

POOL_BLOCKS = 24  # the flood and the nested prompt fit; the fillers cycle the whole pool


def _engine(model_dir: Path, store: HostTierStore, executor=None):
    """(engine, recorder, rank 0's tier) of POOL_BLOCKS blocks over ``executor`` (default:
    the session's runner in process) writing back to ``store``."""
    if executor is None:
        runner = runner_for(Path(model_dir), block_size=BLOCK_SIZE)
        executor = LocalExecutor(runner, RankTier(store, 0, runner.kv_cache))
    tp = getattr(executor, "tensor_parallel_size", 1)
    engine, rec = make_engine(model_dir, num_blocks=POOL_BLOCKS, runner=executor,
                              tier=TierLookup(store, tp), max_num_batched_tokens=12,
                              layer_yield=True)
    if not executor.tier.tag:
        executor.tier.tag = engine.identity_digest
    return engine, rec, executor.tier


@pytest.mark.parametrize("tp", [1, 2])
def test_nested_step_writes_back_and_restores_between_layers(tiny_llama_dir, tp,
                                                             monkeypatch) -> None:
    """tp = 2: thread ranks over real gloo, each moving its own shard of the blocks."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = HostTierStore(TIER_BYTES)
    if tp == 1:
        _check(tiny_llama_dir, *_engine(tiny_llama_dir, store), ())
        return
    with thread_executor(tiny_llama_dir, tp, tier=store) as ex:
        _check(tiny_llama_dir, *_engine(tiny_llama_dir, store, ex),
               tuple(w.tier for w in ex.group.workers))


def _check(model_dir: Path, engine, rec, tier, other_ranks) -> None:
    shared = prompt(17, seed=70)  # 4 full blocks the nested request may take from the tier
    first = request(shared, max_tokens=2)
    run(engine, [first])
    for seed in (71, 72):  # push its blocks out of the pool (written back), fill it with others
        run(engine, [request(prompt(48, seed=seed), max_tokens=2)])
    assert all(engine.kv.pool.lookup(h) is None for h in chain_of(engine, first)), "not evicted"
    assert all(t.flush() for t in (tier, *other_ranks)), "write-backs did not finish"
    saved_before = tier.stats.write_backs

    def batch(n: int, seed: int, m: int):
        return dataclasses.replace(request(prompt(n, seed=seed), max_tokens=m), priority=BATCH)
    arrivals = {0: [batch(5, 80, 8), batch(6, 81, 8)], 2: [batch(30, 82, 4)]}
    chat = dataclasses.replace(request(shared, max_tokens=3), priority=INTERACTIVE)
    start = len(rec.plans)
    yielder = LayerArrivals(engine, [chat])
    results, _ = drive(engine, arrivals, yielder)  # also: invariants each step, no block leak

    assert yielder.fired and engine.stats()["nested_steps"] == 1
    plans = rec.plans[start:]
    nested = plans[plans.index(yielder.paused_plan) - 1]
    assert [c.seq_id for c in nested.chunks] == [f"{chat.request_id}#0"]
    assert len(nested.block_restores) == 4, "the prompt's blocks came from the tier"
    assert nested.block_saves, "the nested allocation evicted cached blocks: written back"
    paused_blocks = {b for c in yielder.paused_plan.chunks for b in c.block_table}
    moved = {b for b, _ in nested.block_restores + nested.block_saves}
    assert not moved & paused_blocks, "a move touched the paused step's blocks"
    assert nested.chunks[0].num_computed_tokens == 16  # only the last prompt token computed
    assert all(t.flush() for t in (tier, *other_ranks))
    assert tier.stats.write_backs > saved_before
    ranks = list(range(1 + len(other_ranks)))
    for h in (h for _, h in nested.block_saves):
        assert engine.scheduler.tier.lookup.store.lookup([h], ranks) == 1, "not in the tier"
    reqs = [*arrivals[0], *arrivals[2], chat]
    errors = {r.request_id: reference_error(model_dir, rec, f"{r.request_id}#0",
                                            seq_tokens(r, results[(r.request_id, 0)]))
              for r in reqs}
    assert max(errors.values()) <= 1, errors
    for r in reqs:
        assert len(results[(r.request_id, 0)].token_ids) == r.params.max_tokens
