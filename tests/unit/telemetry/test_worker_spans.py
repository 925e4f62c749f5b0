"""worker.Generate and its phases, built from the engine's milestones after the fact."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from kvfleet.telemetry import names as n
from kvfleet.telemetry import worker_spans
from kvfleet.telemetry.worker_spans import WorkerTelemetry
from kvfleet.v1 import worker_pb2
from kvfleet.worker.engine.output.outputs import Milestones, SeqOutput, Usage
from kvfleet.worker.engine.request import FinishReason

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def request(rid: str = "r1", n_samples: int = 1, prompt: int = 40):
    req = worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=[7] * prompt,
                                           tenant="acme")
    req.sampling.max_tokens = 4
    if n_samples > 1:
        req.sampling.n = n_samples
    return req


def final(rid, base, reason=FinishReason.LENGTH, index=0, sched=0.010, first=0.050, last=0.080,
          done=0.0801, out_tokens=4, cached=16, chunks=((0.010, 16), (0.030, 8))):
    rel = lambda x: None if x is None else base + x  # noqa: E731
    return SeqOutput(rid, index, (5,), "x", finish_reason=reason,
                     usage=Usage(40, cached, out_tokens),
                     milestones=Milestones(base + 0.001, rel(sched), rel(first), rel(last),
                                           base + done, tuple((base + t, k) for t, k in chunks)))


@pytest.fixture
def wt(worker_capture):
    stats = {"running": 1, "waiting": 2, "num_free_blocks": 48, "num_total_blocks": 64,
             "tenant_service": {"acme": 120.0, "globex": 8.0}, "nested_steps": 3,
             "preemptions": {"blocks": 2, "class": 0, "tenant_seat": 5},
             "replica_s_by_class": {"interactive": 0.25, "batch": 1.5}}
    return WorkerTelemetry(worker_capture.telemetry, "replica-a", "tiny", stats_fn=lambda: stats)


async def test_phases_tile_worker_generate_with_attributes_and_events(wt, worker_capture):
    rt = wt.start(request(), [("traceparent", PARENT)])
    base = rt.start
    wt.on_finished(final("r1", base))
    assert 0 <= rt.handler_done() < 0.08
    spans = worker_capture.spans()
    assert set(spans) == {n.WORKER_GENERATE, n.WORKER_QUEUE, n.WORKER_PREFILL, n.WORKER_DECODE}
    w = spans[n.WORKER_GENERATE]
    assert w.kind is SpanKind.SERVER and w.parent.span_id == 0xb7ad6b7169203331
    assert format(w.context.trace_id, "032x") == PARENT.split("-")[1]
    for name in (n.WORKER_QUEUE, n.WORKER_PREFILL, n.WORKER_DECODE):
        assert spans[name].parent.span_id == w.context.span_id
    ns = lambda s: round(s * 1e9)  # noqa: E731
    q, p, d = spans[n.WORKER_QUEUE], spans[n.WORKER_PREFILL], spans[n.WORKER_DECODE]
    assert q.start_time == w.start_time and q.end_time - q.start_time == pytest.approx(ns(0.010), abs=2)
    assert p.end_time - p.start_time == pytest.approx(ns(0.040), abs=2)
    assert d.end_time - d.start_time == pytest.approx(ns(0.0301), abs=2)
    assert d.end_time == w.end_time  # the engine finished after the handler returned here
    assert p.attributes[n.KVFLEET_PREFILL_CHUNKS] == 2
    assert [e.attributes[n.KVFLEET_CHUNK_TOKENS] for e in p.events] == [16, 8]
    assert p.events[1].timestamp - p.events[0].timestamp == pytest.approx(ns(0.020), abs=2)
    assert p.attributes[n.KVFLEET_CACHED_PROMPT_TOKENS] == 16
    assert [e.name for e in d.events] == [n.EVENT_FIRST_TOKEN]
    assert d.attributes[n.KVFLEET_TPOT_S] == pytest.approx(0.030 / 3)
    assert w.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert w.attributes[n.GEN_AI_USAGE_INPUT_TOKENS] == 40
    assert w.attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert w.attributes[n.KVFLEET_REPLICA_ID] == "replica-a" and w.attributes[n.KVFLEET_REQUEST_ID] == "r1"
    assert w.status.status_code is StatusCode.UNSET
    # Metrics: one TTFT per request, TPOT, token counters, gauges.
    (ttft,) = worker_capture.points(n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.050)
    assert worker_capture.points(n.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN)[0].sum == pytest.approx(0.01)
    assert worker_capture.points(n.METRIC_PREFIX_HIT_TOKENS)[0].value == 16
    assert worker_capture.points(n.METRIC_PROMPT_TOKENS)[0].value == 40
    assert worker_capture.points(n.METRIC_KV_CACHE_USAGE)[0].value == pytest.approx(0.25)
    states = {p.attributes[n.KVFLEET_REQUEST_STATE]: p.value
              for p in worker_capture.points(n.METRIC_REQUESTS)}
    assert states == {"running": 1, "waiting": 2}
    service = {p.attributes[n.KVFLEET_TENANT]: p.value
               for p in worker_capture.points(n.METRIC_TENANT_SERVICE)}
    assert service == {"acme": 120.0, "globex": 8.0}  # the scheduler's fairness counters
    assert [p.value for p in worker_capture.points(n.METRIC_NESTED_STEPS)] == [3]
    preempted = {p.attributes[n.KVFLEET_PREEMPT_REASON]: p.value
                 for p in worker_capture.points(n.METRIC_PREEMPTIONS)}
    assert preempted == {"blocks": 2, "class": 0, "tenant_seat": 5}
    by_class = {p.attributes[n.KVFLEET_PRIORITY_CLASS]: p.value
                for p in worker_capture.points(n.METRIC_REPLICA_TIME)}
    assert by_class == {"interactive": 0.25, "batch": 1.5}
    assert not wt._open  # nothing left behind


async def test_cancelled_before_first_token_ends_with_status_after_the_engine(wt, worker_capture):
    rt = wt.start(request(), ())
    base = rt.start
    rt.handler_done(asyncio.CancelledError)  # the caller went away first
    assert worker_capture.spans() == {}      # still waiting for the engine's abort
    wt.on_finished(final("r1", base, FinishReason.CANCELLED, first=None, last=None, done=0.02,
                         out_tokens=0))
    spans = worker_capture.spans()
    assert set(spans) == {n.WORKER_GENERATE, n.WORKER_QUEUE, n.WORKER_PREFILL}
    for name in (n.WORKER_GENERATE, n.WORKER_PREFILL):
        s = spans[name]
        assert s.status.status_code is StatusCode.ERROR and "CANCELLED" in s.status.description
        assert s.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("cancelled",)
    assert spans[n.WORKER_PREFILL].end_time == spans[n.WORKER_GENERATE].end_time
    assert worker_capture.count(n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN) == 0  # not a success
    (dur,) = worker_capture.points(n.METRIC_WORKER_REQUEST_DURATION)
    assert dur.attributes[n.ERROR_TYPE] == "CANCELLED"


async def test_refused_request_has_no_phases(wt, worker_capture):
    with pytest.raises(RuntimeError):
        with wt.start(request(), ()) as rt:
            rt.refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            raise RuntimeError("abort")
    (w,) = worker_capture.spans().values()
    assert w.name == n.WORKER_GENERATE and w.status.status_code is StatusCode.ERROR
    assert w.attributes[n.RPC_GRPC_STATUS_CODE] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert w.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("error",)
    # A caller's mistake is not a server error (RPC conventions): status stays unset.
    with pytest.raises(RuntimeError):
        with wt.start(request("r2"), ()) as rt:
            rt.refused(grpc.StatusCode.INVALID_ARGUMENT, "bad")
            raise RuntimeError("abort")
    assert worker_capture.spans()[n.WORKER_GENERATE].status.status_code is StatusCode.UNSET
    assert not wt._open


async def test_n_samples_make_one_request(wt, worker_capture):
    rt = wt.start(request(n_samples=2), ())
    base = rt.start
    wt.on_finished(final("r1", base, index=0, first=0.05, done=0.09))
    assert worker_capture.count(n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN) == 0
    wt.on_finished(final("r1", base, FinishReason.STOP, index=1, first=0.04, done=0.07,
                         out_tokens=2))
    rt.handler_done()
    assert worker_capture.count(n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN) == 1
    w = worker_capture.spans()[n.WORKER_GENERATE]
    assert w.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("length", "stop")
    assert w.attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    d = worker_capture.spans()[n.WORKER_DECODE]
    assert (d.end_time - d.start_time) == pytest.approx(round(0.05e9), abs=2)  # 0.04 → 0.09


async def test_engine_silence_ends_spans_after_a_timeout(wt, worker_capture, monkeypatch):
    monkeypatch.setattr(worker_spans, "ORPHAN_TIMEOUT_S", 0.01)
    rt = wt.start(request(), ())
    rt.handler_done(GeneratorExit)
    await asyncio.sleep(0.05)
    (w,) = worker_capture.spans().values()
    assert w.status.status_code is StatusCode.ERROR
    assert not wt._open
    wt.on_finished(final("r1", rt.start))  # late: ignored


async def test_duplicate_request_id_does_not_steal_the_first(wt, worker_capture):
    first = wt.start(request("dup"), ())
    second = wt.start(request("dup"), ())
    assert wt._open["dup"] is first
    with pytest.raises(RuntimeError):
        with second:
            second.refused(grpc.StatusCode.INVALID_ARGUMENT, "already running")
            raise RuntimeError
    assert wt._open["dup"] is first


async def test_adapter_is_a_span_attribute_and_a_bounded_metric_label(worker_capture):
    wt = WorkerTelemetry(worker_capture.telemetry, "replica-a", "tiny", adapters_fn=lambda: {"sql"})
    for rid, adapter in (("r1", "sql"), ("r2", "made-up")):
        req = request(rid)
        req.adapter = adapter
        rt = wt.start(req, [])
        wt.on_finished(final(rid, rt.start))
        rt.handler_done()
    spans = [s for s in worker_capture.spans_out.get_finished_spans() if s.name == n.WORKER_GENERATE]
    assert {s.attributes[n.KVFLEET_ADAPTER] for s in spans} == {"sql", "made-up"}
    assert all(s.attributes[n.GEN_AI_REQUEST_MODEL] == "tiny" for s in spans)  # stays the base
    labels = {p.attributes.get(n.KVFLEET_ADAPTER)
              for p in worker_capture.points(n.METRIC_WORKER_REQUEST_DURATION)}
    assert labels == {"sql", None}  # an adapter the replica was not configured with: no label


def test_predicted_and_measured_step_time_are_exported(worker_capture):
    from kvfleet.worker.step_cost.model import CostModel, StepCost

    cost = StepCost(CostModel(0.01, 0.001, 0.002, "fake"), alpha=0.5)
    WorkerTelemetry(worker_capture.telemetry, "replica-a", "tiny", step_cost=cost)
    cost.observe((2, 10, 0), 0.048)  # predicted 0.024 s, measured twice that
    cost.observe((0, 0, 0), 1.0)     # an empty step: not a forward
    (predicted,) = worker_capture.points(n.METRIC_STEP_PREDICTED)
    (measured,) = worker_capture.points(n.METRIC_STEP_MEASURED)
    assert predicted.value == pytest.approx(0.024) and measured.value == pytest.approx(0.048)
    assert predicted.attributes[n.GEN_AI_REQUEST_MODEL] == "tiny"
    assert worker_capture.points(n.METRIC_STEPS)[0].value == 1
    # alpha × log 2 shared by the sides' shares of the prediction (decode 0.014 s, prefill
    # 0.010 s of 0.024 s), normalized by the sum of the squared shares (296 / 24²)
    scales = {p.attributes[n.KVFLEET_STEP_SIDE]: p.value for p in worker_capture.points(n.METRIC_STEP_COST_SCALE)}
    assert scales == pytest.approx({"decode": 2 ** (0.5 * 14 * 24 / 296), "prefill": 2 ** (0.5 * 10 * 24 / 296)})


async def test_speculative_counts_on_the_decode_span_and_in_metrics(wt, worker_capture):
    """Drafts verified / accepted: attributes of worker.decode summed over the samples, token
    counters, and one acceptance point per request that drafted."""
    rt = wt.start(request("s1", n_samples=2), [("traceparent", PARENT)])
    base = rt.start
    for i, (drafted, accepted) in enumerate(((10, 6), (6, 2))):
        f = final("s1", base, index=i)
        wt.on_finished(dataclasses.replace(f, milestones=dataclasses.replace(
            f.milestones, spec_drafted=drafted, spec_accepted=accepted)))
    rt.handler_done()
    d = worker_capture.spans()[n.WORKER_DECODE]
    assert d.attributes[n.KVFLEET_SPEC_DRAFTED] == 16 and d.attributes[n.KVFLEET_SPEC_ACCEPTED] == 8
    assert worker_capture.points(n.METRIC_SPEC_DRAFTED)[0].value == 16
    assert worker_capture.points(n.METRIC_SPEC_ACCEPTED)[0].value == 8
    (acceptance,) = worker_capture.points(n.METRIC_SPEC_ACCEPTANCE)
    assert acceptance.count == 1 and acceptance.sum == pytest.approx(0.5)
    plain = wt.start(request("s2"), [])
    wt.on_finished(final("s2", plain.start))
    plain.handler_done()
    assert n.KVFLEET_SPEC_DRAFTED not in worker_capture.spans()[n.WORKER_DECODE].attributes
