"""A stopped replica frees its weights and KV cache even while it is still referenced.

A bench or test keeps its stopped ``ReplicaServer`` objects (and the server's callbacks put it
in reference cycles, freed only by a full collection): before ``stop()`` released the model, a
driver that built fleet after fleet grew ~2 GB per fleet (SmolLM2, 2 replicas).
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

from kvfleet.worker.replica.replica import ReplicaServer
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.fixtures.cluster import tiny_replica


def _projection_tensors(model) -> list:
    """Every projection's weight (and one-row copy), under a LoRA wrapper or not."""
    out = []
    for p in model.projections():
        base = getattr(p, "base", p)
        out += [t for t in (getattr(base, "weight", None), getattr(base, "rows", None))
                if isinstance(t, torch.Tensor)]
    return out


def test_stopped_replica_holds_no_weights_or_kv(tiny_llama_dir, tmp_path) -> None:
    cfg = tiny_replica(tiny_llama_dir, None, "kvtest-release:", step_cost_dir=str(tmp_path),
                       calibration_budget_s=0.5)
    server = ReplicaServer(cfg)
    runner = server.engine.executor.runner
    held = [runner.model, runner.kv_cache.data, *runner.model.parameters(),
            *_projection_tensors(runner.model)]
    tensors = [weakref.ref(t) for t in held]
    del held
    assert len(tensors) > 20 and server.ranks()[0].kv_bytes > 0

    async def serve_then_stop() -> None:
        await server.start()
        await server.stop(grace_s=0.0)
        await server.stop(grace_s=0.0)  # idempotent

    gc.disable()  # the release must not depend on the cycle collector
    try:
        asyncio.run(serve_then_stop())
        alive = [w for w in tensors if w() is not None]
    finally:
        gc.enable()
    assert alive == [], f"{len(alive)} of {len(tensors)} weight/KV objects outlive stop()"
    rank = server.ranks()[0]  # still answers, with nothing held
    assert (rank.kv_bytes, rank.num_blocks, rank.weight_bytes) == (0, 0, 0)


def test_released_runner_refuses_to_run(tiny_llama_dir) -> None:
    from kvfleet.worker.engine.step_plan import StepPlan

    runner = ModelRunner(tiny_llama_dir, num_blocks=4, block_size=16)
    runner.release()
    runner.release()  # idempotent
    assert runner.kv_cache.data.shape[2] == 0 and runner.weight_nbytes() == 0
    with pytest.raises(AssertionError, match="released"):
        runner.execute(StepPlan(chunks=()))


async def test_stop_ends_a_heartbeat_whose_cancel_was_swallowed(tiny_llama_dir, redis_server) -> None:
    """A cancel that lands inside a Redis call can come back as a Redis error, which the
    publisher swallows (an outage): stop() must neither wait on that task for ever nor leave it
    beating (it would re-register the stopped replica)."""
    cfg = tiny_replica(tiny_llama_dir, redis_server.url, "kvtest-stopbeat:", executor="cost-model",
                       heartbeat_interval_s=0.01)
    server = ReplicaServer(cfg)
    await server.start()
    beats = 0
    inside = asyncio.Event()

    async def swallowing_beat(load) -> None:
        nonlocal beats
        beats += 1
        inside.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # what redis-py's error mapping plus the publisher's outage guard amount to

    server.publisher.heartbeat = swallowing_beat
    await asyncio.wait_for(inside.wait(), 5)
    await asyncio.wait_for(server.stop(grace_s=0.0), 10)
    after_stop = beats
    await asyncio.sleep(0.2)
    assert beats <= after_stop + 1, f"{beats - after_stop} beats after stop()"
