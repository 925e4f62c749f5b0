"""Replica-seconds per request (``Timing.replica_s``): the engine shares each step's measured
forward seconds among its rows (``step_cost/share.py``), so the finished samples' shares add
up to the replica's forward seconds, nested (layer-yield) steps counted once."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest

from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.engine import engine as engine_module
from kvfleet.worker.engine.layer_yield import forward as forward_module
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.executor.cost_model import CostModelExecutor
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.step_cost.model import CostModel, StepCost
from tests.unit.worker.engine_harness import BLOCK_SIZE, make_engine, prompt, request, run

COST = CostModel(0.01, 0.001, 0.002, "test", 1e-6)


def finished(results) -> list[SeqOutput]:
    return [r.last for r in results.values() if r.last is not None]


def test_the_samples_shares_add_up_to_the_engines_forward_seconds(tiny_llama_dir):
    """Concurrent requests of different prompt lengths, one with n = 2, on the real runner."""
    engine, rec = make_engine(tiny_llama_dir)
    reqs = [request(prompt(40, 1), 6), request(prompt(9, 2), 4), request(prompt(23, 3), 5, n=2,
                                                                         temperature=1.0, seed=1)]
    results = run(engine, {0: reqs[:2], 2: reqs[2:]})
    last = finished(results)
    assert len(last) == 4 and all(o.timing.replica_s > 0 for o in last)
    assert engine.step_cost.steps == len(rec.plans)  # every forward observed (and charged)
    assert math.fsum(o.timing.replica_s for o in last) == pytest.approx(
        engine.step_cost.measured_total_s, rel=1e-9)
    # the per-class counter is the same seconds (every request here is in class default)
    assert engine.stats()["replica_s_by_class"] == {
        "default": pytest.approx(engine.step_cost.measured_total_s, rel=1e-9)}
    # the gaps between busy forwards (sampling, emitting, scheduling) were measured too
    assert engine.step_cost.outside_s > 0


class ArriveOnce:
    """An :class:`~kvfleet.worker.engine.layer_yield.forward.Arrivals` double: ``req`` arrives
    after the first layer of the first step run with it."""

    def __init__(self, engine, req) -> None:
        self.engine, self.req, self.emitted = engine, req, []

    def pending(self) -> bool:
        return self.req is not None

    def take(self) -> None:
        self.engine.add_request(self.req)
        self.req = None

    def emit(self, outputs: list[SeqOutput]) -> None:
        self.emitted += outputs


def test_a_nested_steps_seconds_are_its_rows_and_not_the_paused_steps(tiny_llama_dir, monkeypatch):
    """Cost-model replica on a fake clock that moves only while a forward "runs": each step
    measures exactly its modelled seconds, so the shares must add up to the executor's modelled
    total; charging the paused step its nested step's seconds too would exceed it."""
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    clock = types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=lambda: 1e6 + now[0])
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(forward_module, "time", clock)
    executor = CostModelExecutor(load_model_config(tiny_llama_dir), COST, filler_token_id=42,
                                 num_blocks=64, block_size=BLOCK_SIZE, sleep=sleep,
                                 clock=lambda: now[0])
    engine, _ = make_engine(tiny_llama_dir, num_blocks=64, runner=executor,
                            step_cost=StepCost(COST, alpha=0.0), layer_yield="on")
    engine.executor = executor  # unwrapped: the recorder knows the real runner's paused forward
    batch = [dataclasses.replace(request(prompt(30, i), 6), priority=BATCH) for i in range(3)]
    chat = dataclasses.replace(request(prompt(12, 9), 3), priority=INTERACTIVE)
    for r in batch:
        engine.add_request(r)
    outputs = engine.step()  # the batch prefill: the trickle arrives during the next step
    arrivals = ArriveOnce(engine, chat)
    for _ in range(100):
        if not engine.has_work and arrivals.req is None:
            break
        outputs += engine.step(arrivals)
    last = [o for o in outputs + arrivals.emitted if o.finished]
    assert engine.forward.nested_steps >= 1 and len(last) == 4
    assert all(o.timing.replica_s > 0 for o in last)
    assert executor.steps == engine.step_cost.steps  # nested ones included, each once
    assert math.fsum(o.timing.replica_s for o in last) == pytest.approx(executor.busy_s, rel=1e-9)
    chat_s = next(o.timing.replica_s for o in last if o.request_id == chat.request_id)
    assert chat_s < executor.busy_s / 2  # its own rows, not the paused step's
    by_class = engine.stats()["replica_s_by_class"]  # the counter a bench scrapes, per class
    assert by_class == {"interactive": pytest.approx(chat_s, rel=1e-9),
                        "batch": pytest.approx(executor.busy_s - chat_s, rel=1e-9)}
    engine.kv.check_invariants()
