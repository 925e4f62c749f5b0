"""Layer-level yield in the engine (``layer_yield/forward.py``): a step paused between decoder layers
for a nested interactive prefill, over the real tiny runners, against transformers.

The arrival is forced (never timed): :class:`LayerArrivals` makes the requests "arrive"
after ``after_layers`` layers of the first step whose plan mixes a prefill chunk and decode
rows. Tolerance and harness: ``test_engine_exactness.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types
from typing import Callable

import pytest

from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.stream_limits import Outbox
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.engine.scheduling.config import SchedulerConfig
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.service.engine_loop import EngineLoop, _Abort, _Add
from tests.unit.worker.engine_harness import (
    collect,
    make_engine,
    prompt,
    reference_error,
    request,
    seq_tokens,
)
from tests.unit.worker.engine_harness import run as run_all
from tests.unit.worker.executor.tp.thread_executor import thread_executor
from tests.unit.worker.lora_harness import lora_error, make_lora_engine, with_adapter


def mixed(plan: StepPlan) -> bool:
    """A step with a prefill chunk that leaves its prompt unfinished and a decode row."""
    return (any(len(c.token_ids) == 1 for c in plan.chunks)
            and any(len(c.token_ids) > 1 for c in plan.chunks))


class LayerArrivals:
    """:class:`~kvfleet.worker.engine.layer_yield.forward.Arrivals` double: ``reqs`` arrive after
    ``after_layers`` layers of the first plan ``when`` accepts (armed by :class:`Arming`)."""

    def __init__(self, engine: Engine, reqs: list[EngineRequest],
                 when: Callable[[StepPlan], bool] = mixed, after_layers: int = 1) -> None:
        self.engine, self.reqs, self.when, self.after = engine, reqs, when, after_layers
        self.layers, self.armed, self.fired = 0, False, False
        self.paused_plan: StepPlan | None = None
        self.emitted: list[SeqOutput] = []
        self.pending_calls = 0
        engine.executor = Arming(engine.executor, self)

    def pending(self) -> bool:
        self.pending_calls += 1
        if not self.armed:
            return False
        self.layers += 1
        return self.layers >= self.after

    def take(self) -> None:
        self.armed, self.fired = False, True
        for r in self.reqs:
            self.engine.add_request(r)

    def emit(self, outputs: list[SeqOutput]) -> None:
        self.emitted.extend(outputs)


class Arming:
    """Wraps the engine's executor: arms ``arrivals`` on the plan it waits for."""

    def __init__(self, inner, arrivals: LayerArrivals) -> None:
        self.inner, self.arrivals = inner, arrivals

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute_pausable(self, plan: StepPlan, should_yield):
        a = self.arrivals
        if not a.fired and a.when(plan):
            a.armed, a.paused_plan = True, plan
        return self.inner.execute_pausable(plan, should_yield)


class IntoPausedSlots(Arming):
    """Negative control: the nested step's chunks get the paused step's longest block table
    (its forward then writes into the paused sequence's slots)."""

    def execute(self, plan: StepPlan):
        paused = self.arrivals.paused_plan
        if self.arrivals.fired and paused is not None and plan is not paused:
            table = max((c.block_table for c in paused.chunks), key=len)
            plan = dataclasses.replace(plan, chunks=tuple(
                dataclasses.replace(c, block_table=table) for c in plan.chunks))
            self.arrivals.paused_plan = None  # once
        return self.inner.execute(plan)


def drive(engine: Engine, arrivals: dict[int, list[EngineRequest]], yielder: LayerArrivals,
          max_steps: int = 500) -> tuple[dict, list[list[SeqOutput]]]:
    """Step until idle, offering ``yielder`` as every step's arrivals. Returns the results
    and, per step, the nested outputs emitted during it followed by the step's own."""
    results: dict = {}
    per_step: list[list[SeqOutput]] = []
    for k in range(max_steps):
        for r in arrivals.get(k, ()):
            engine.add_request(r)
        before = len(yielder.emitted)
        own = engine.step(yielder)
        per_step.append(yielder.emitted[before:] + own)
        collect(results, per_step[-1])
        engine.kv.check_invariants()
        if k >= max(arrivals) and not engine.has_work:
            break
    else:
        raise AssertionError("engine still busy")
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks, "blocks leaked"
    return results, per_step


def workload(adapter: str = "") -> tuple[dict[int, list[EngineRequest]], list[EngineRequest]]:
    """Two batch decodes, then a 30-token batch prompt chunked beside them (12 tokens a
    step); the nested request: a 9-token interactive prompt (one nested chunk)."""
    def batch(n: int, seed: int, m: int) -> EngineRequest:
        req = dataclasses.replace(request(prompt(n, seed=seed), max_tokens=m), priority=BATCH)
        return with_adapter(req, adapter) if adapter else req
    early = [batch(5, 80, 8), batch(6, 81, 8)]
    late = batch(30, 82, 4)
    chat = dataclasses.replace(request(prompt(9, seed=83), max_tokens=3), priority=INTERACTIVE)
    return {0: early, 2: [late]}, [chat]


def parity_errors(model_dir, rec, arrivals, nested, results) -> dict[str, float]:
    reqs = [r for rs in arrivals.values() for r in rs] + nested
    return {r.request_id: reference_error(model_dir, rec, f"{r.request_id}#0",
                                          seq_tokens(r, results[(r.request_id, 0)]))
            for r in reqs}


def test_paused_mixed_step_and_nested_prefill_match_transformers(model_dir) -> None:
    arrivals, nested = workload()
    engine, rec = make_engine(model_dir, max_num_batched_tokens=12, layer_yield=True)
    yielder = LayerArrivals(engine, nested)
    results, per_step = drive(engine, arrivals, yielder)
    paused = yielder.paused_plan
    assert yielder.fired and paused is not None
    assert engine.stats()["nested_steps"] == 1
    prefill = next(c for c in paused.chunks if len(c.token_ids) > 1)
    assert prefill.num_computed_tokens + len(prefill.token_ids) < 30, "a chunked prefill row"
    # The nested plan ran (and was recorded) before the paused one completed.
    i = rec.plans.index(paused)
    assert [c.seq_id for c in rec.plans[i - 1].chunks] == [f"{nested[0].request_id}#0"]
    assert not {c.seq_id for c in rec.plans[i - 1].chunks} & {c.seq_id for c in paused.chunks}
    # Its first token went out during the paused step, before that step's own outputs.
    step = next(s for s in per_step if any(o.request_id == nested[0].request_id for o in s))
    assert step[0].request_id == nested[0].request_id
    assert {o.request_id for o in step[1:]} >= {r.request_id for r in arrivals[0]}
    errors = parity_errors(model_dir, rec, arrivals, nested, results)
    assert max(errors.values()) <= 1, errors
    for r in [*arrivals[0], *arrivals[2], *nested]:
        assert len(results[(r.request_id, 0)].token_ids) == r.params.max_tokens


def test_negative_control_nested_step_in_the_paused_slots_fails_parity(tiny_llama_dir) -> None:
    arrivals, nested = workload()
    engine, rec = make_engine(tiny_llama_dir, max_num_batched_tokens=12, layer_yield=True)
    yielder = LayerArrivals(engine, nested)
    engine.executor = IntoPausedSlots(rec, yielder)
    results, _ = drive(engine, arrivals, yielder)
    assert yielder.fired
    errors = parity_errors(tiny_llama_dir, rec, arrivals, nested, results)
    assert max(errors.values()) > 1, f"corrupted slots went unnoticed: {errors}"


def test_paused_adapter_rows_keep_their_adapter_across_a_base_nested_step(
        tiny_llama_dir, tiny_adapters) -> None:
    """The paused step's rows run adapter ``qv``; the nested step runs the base model (its
    own adapter batch: None); after it the paused rows resume with ``qv`` again."""
    arrivals, nested = workload(adapter="qv")
    engine, rec, _ = make_lora_engine(tiny_llama_dir, {"qv": tiny_adapters["qv"]},
                                      max_num_batched_tokens=12, layer_yield=True)
    yielder = LayerArrivals(engine, nested)
    results, _ = drive(engine, arrivals, yielder)
    assert yielder.fired and {c.adapter_slot for c in yielder.paused_plan.chunks} == {1}
    for r in [r for rs in arrivals.values() for r in rs]:
        err = lora_error(tiny_llama_dir, tiny_adapters["qv"], rec, r, results[(r.request_id, 0)])
        assert err <= 1, f"{r.request_id}: {err:.2f}x"
    assert lora_error(tiny_llama_dir, None, rec, nested[0], results[(nested[0].request_id, 0)]) <= 1


def test_a_less_served_tenants_prompt_nests_in_a_flood_step_and_matches_transformers(
        tiny_llama_dir) -> None:
    """One class, two tenants, ``tenant_share`` 0.5: tenant A's mixed step (decode rows and
    a chunked prompt) pauses for tenant B's new prompt, served less; every output matches
    the reference model."""
    arrivals, _ = workload()
    arrivals = {k: [dataclasses.replace(r, priority=DEFAULT, tenant="A") for r in rs]
                for k, rs in arrivals.items()}
    nested = [dataclasses.replace(request(prompt(9, seed=85), max_tokens=3), tenant="B")]
    engine, rec = make_engine(tiny_llama_dir, max_num_batched_tokens=12, layer_yield=True,
                              tenant_share=0.5)
    yielder = LayerArrivals(engine, nested)
    results, _ = drive(engine, arrivals, yielder)
    assert yielder.fired and engine.stats()["nested_steps"] == 1
    i = rec.plans.index(yielder.paused_plan)
    assert [c.seq_id for c in rec.plans[i - 1].chunks] == [f"{nested[0].request_id}#0"]
    errors = parity_errors(tiny_llama_dir, rec, arrivals, nested, results)
    assert max(errors.values()) <= 1, errors


def test_an_arrival_the_step_does_not_yield_to_is_taken_once_and_never_pauses(
        tiny_llama_dir) -> None:
    """A batch arrival beside batch rows: taken into the queue at the layer it is seen, no
    pause, no nested step, no further look at it (one take, then cheap pending calls)."""
    arrivals, _ = workload()
    other = dataclasses.replace(request(prompt(7, seed=84), max_tokens=2), priority=BATCH)
    engine, rec = make_engine(tiny_llama_dir, max_num_batched_tokens=12, layer_yield=True)
    yielder = LayerArrivals(engine, [other])
    taken = []
    yielder.take = lambda: (taken.append(1), LayerArrivals.take(yielder))  # type: ignore[method-assign]
    results, per_step = drive(engine, arrivals, yielder)
    assert taken == [1] and not yielder.emitted and engine.stats()["nested_steps"] == 0
    i = rec.plans.index(yielder.paused_plan)
    assert f"{other.request_id}#0" not in {c.seq_id for c in rec.plans[i - 1].chunks}, \
        "no nested step ran"
    assert yielder.pending_calls > yielder.layers >= 1  # looked at every layer, cheaply
    assert len(results[(other.request_id, 0)].token_ids) == 2


def test_layer_yield_needs_a_pausable_executor(tiny_llama_dir) -> None:
    engine, rec = make_engine(tiny_llama_dir)
    whole = types.SimpleNamespace(pausable=False)  # e.g. tensor-parallel ranks
    with pytest.raises(ValueError, match="layer_yield"):
        Engine(whole, engine.kv, engine.tokenizer, b"x", [], 64, 10,  # type: ignore[arg-type]
               dataclasses.replace(engine.scheduler.config, layer_yield=True))


def test_engine_loop_takes_new_requests_mid_step_and_applies_an_abort_after_it(
        tiny_llama_dir) -> None:
    """Through :class:`EngineLoop`'s inbox (its thread not started): an abort of a running
    batch request and a new interactive request arrive during a step; the request runs
    nested, the abort waits for the step's end, and every block comes back."""
    arrivals, nested = workload()
    engine, rec = make_engine(tiny_llama_dir, max_num_batched_tokens=12, layer_yield=True)
    loop = asyncio.new_event_loop()
    try:
        eloop = EngineLoop(engine, loop)
        victim = arrivals[0][0]
        for r in arrivals[0]:
            engine.add_request(r)
        engine.step()  # both prefill: the next step is two decode rows
        eloop._inbox.put(_Abort(victim.request_id, FinishReason.CANCELLED))
        eloop._inbox.put(_Add(nested[0], Outbox(64, lambda: None, "t"), loop.create_future()))
        outs = engine.step(eloop)
        assert eloop._inbox.deferred and engine.is_active(victim.request_id), "abort waits"
        assert [p.chunks[0].seq_id for p in rec.plans[-2:-1]] == [f"{nested[0].request_id}#0"]
        assert any(o.request_id == victim.request_id for o in outs)
        eloop._drain_inbox(block=False)
        assert not engine.is_active(victim.request_id) and not eloop._inbox.deferred
        while engine.has_work:
            engine.step(eloop)
        engine.kv.check_invariants()
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    finally:
        loop.close()


def test_a_replica_config_takes_layer_yield_beside_tensor_parallel_ranks_and_a_tier() -> None:
    from kvfleet.worker.engine.scheduling.config import SchedulerConfig
    from kvfleet.worker.replica.replica import ReplicaConfig

    cfg = ReplicaConfig(replica_id="r", model_name="m", model_dir="/m", tensor_parallel_size=2,
                        kv_host_memory_bytes=1 << 26, scheduler=SchedulerConfig(layer_yield=True))
    assert cfg.scheduler.layer_yield and cfg.tensor_parallel_size == 2


class HoldAfterFirstLayer:
    """Wraps the engine's executor: the first pausable step holds after its first layer
    until ``release`` is set (``held`` tells the test), then asks the real ``should_yield``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.held, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute_pausable(self, plan: StepPlan, should_yield):
        if self.held.is_set():
            return self.inner.execute_pausable(plan, should_yield)

        def hold() -> bool:
            if not self.held.is_set():
                self.held.set()
                assert self.release.wait(30), "the test never released the step"
            return should_yield()
        return self.inner.execute_pausable(plan, hold)


def test_engine_loop_thread_streams_the_nested_first_token_before_the_paused_steps(
        tiny_llama_dir) -> None:
    """The engine thread for real: an interactive request submitted while a batch prompt's
    step is between layers gets its first token out before the batch request's (which that
    step produces). Synchronised by events, never by time."""
    engine, rec = make_engine(tiny_llama_dir, layer_yield=True)
    hold = HoldAfterFirstLayer(rec)
    engine.executor = hold
    batch = dataclasses.replace(request(prompt(20, seed=90), max_tokens=3), priority=BATCH)
    chat = dataclasses.replace(request(prompt(9, seed=91), max_tokens=2), priority=INTERACTIVE)
    seen: list[str] = []

    async def consume(eloop: EngineLoop, req: EngineRequest) -> None:
        async for o in eloop.generate(req):
            seen.append(o.request_id)

    async def main() -> None:
        eloop = EngineLoop(engine, asyncio.get_running_loop())
        eloop.start()
        try:
            first = asyncio.create_task(consume(eloop, batch))
            assert await asyncio.to_thread(hold.held.wait, 30)
            second = asyncio.create_task(consume(eloop, chat))
            while eloop._inbox.empty():  # the add is queued before the step goes on
                await asyncio.sleep(0)
            hold.release.set()
            await asyncio.wait_for(asyncio.gather(first, second), 60)
        finally:
            eloop.stop()
    asyncio.run(main())
    assert seen[0] == chat.request_id and seen.count(batch.request_id) == 3
    plans = [[c.seq_id for c in p.chunks] for p in rec.plans]
    assert plans[:2] == [[f"{chat.request_id}#0"], [f"{batch.request_id}#0"]], "nested first"
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen3_dir"], indirect=True)
def test_paused_step_and_nested_prefill_over_tp2_ranks_match_transformers(model_dir) -> None:
    """tp = 2 (thread ranks, real gloo): rank 0 pauses after layer 1, both ranks run the
    nested plan and resume; every sequence's logits as transformers' full-prefix forward."""
    arrivals, nested = workload()
    with thread_executor(model_dir, 2) as ex:
        engine, rec = make_engine(model_dir, runner=ex, max_num_batched_tokens=12,
                                  layer_yield=True)
        yielder = LayerArrivals(engine, nested)
        results, _ = drive(engine, arrivals, yielder)
        assert yielder.fired and engine.stats()["nested_steps"] == 1
        i = rec.plans.index(yielder.paused_plan)
        assert [c.seq_id for c in rec.plans[i - 1].chunks] == [f"{nested[0].request_id}#0"]
        # After the nested plan, the next whole step still runs on both ranks.
        engine.add_request(request(prompt(6, seed=85), max_tokens=2))
        while engine.has_work:
            engine.step()
    errors = parity_errors(model_dir, rec, arrivals, nested, results)
    assert max(errors.values()) <= 1, errors


def test_auto_pauses_once_the_replica_has_taken_two_priorities(tiny_llama_dir) -> None:
    """The default (``auto``): while only batch requests were ever queued every forward runs
    whole; once an interactive request was taken, a later one runs nested, and every logits
    row still matches transformers."""
    assert SchedulerConfig().layer_yield == "auto"
    arrivals, nested = workload()
    engine, rec = make_engine(tiny_llama_dir, max_num_batched_tokens=12)
    yielder = LayerArrivals(engine, [], when=lambda plan: True)
    drive(engine, arrivals, yielder)  # batch only: never a pausable forward
    assert yielder.paused_plan is None and yielder.pending_calls == 0
    engine, rec = make_engine(tiny_llama_dir, max_num_batched_tokens=12)
    run_all(engine, [dataclasses.replace(request(prompt(4, seed=86), max_tokens=1),
                                         priority=INTERACTIVE)])
    yielder = LayerArrivals(engine, nested)
    results, _ = drive(engine, arrivals, yielder)
    assert engine.stats()["nested_steps"] == 1
    errors = parity_errors(tiny_llama_dir, rec, arrivals, nested, results)
    assert max(errors.values()) <= 1, errors
    off = SchedulerConfig(layer_yield=False)
    assert off.layer_yield == "off" and SchedulerConfig(layer_yield=True).layer_yield == "on"
    with pytest.raises(ValueError, match="layer_yield"):
        SchedulerConfig(layer_yield="sometimes")
