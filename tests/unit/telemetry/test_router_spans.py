"""router.Generate ⊃ tokenize, route, dispatch; network time; failure and cancellation."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import Candidate
from kvfleet.sampling_params import SamplingParams
from kvfleet.telemetry import names as n
from kvfleet.telemetry.router_spans import RouterTelemetry
from kvfleet.v1 import common_pb2

CHOSEN = Candidate(ReplicaInfo("replica-b", "127.0.0.1:9", "tiny", 1, 16),
                   ReplicaLoad(1, 0, 10, 10, 0.0), matched_blocks=3, inflight=0, settled=1,
                   host_blocks=2)
OTHER = Candidate(ReplicaInfo("replica-a", "127.0.0.1:8", "tiny", 1, 16), None, 1, 2)
DECISION = SimpleNamespace(candidate=CHOSEN, num_blocks=5, redis_s=0.0002, index_used=True,
                           index_source="mirror", candidates=(OTHER, CHOSEN))


def last_message(prompt=40, cached=32, out=4):
    return common_pb2.GenerateResponse(finish_reason=common_pb2.LENGTH, usage=common_pb2.Usage(
        prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=out))


def test_a_request_makes_the_tree_and_network_time(router_capture):
    rt = RouterTelemetry(router_capture.telemetry)
    with rt.request([("authorization", "x"), ("traceparent",
                     "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")], "messages") as t:
        t.on_request("tiny", SamplingParams(max_tokens=4, seed=7), "acme")
        with t.tokenize() as tok:
            tok["tokens"] = 40
        start = time.monotonic()
        t.routed(start, DECISION, "prefix_aware")
        md = dict(t.start_dispatch("req-1", "replica-b", "127.0.0.1:9"))
        t.on_final(last_message())
        time.sleep(0.01)
        network = t.dispatched([(n.MD_WORKER_DURATION_S, "0.004000")])
        trailers = dict(t.trailers())
    spans = router_capture.spans()
    g, d = spans[n.ROUTER_GENERATE], spans[n.ROUTER_DISPATCH]
    assert g.kind is SpanKind.SERVER and d.kind is SpanKind.CLIENT
    assert g.parent.span_id == 0xb7ad6b7169203331
    for name in (n.ROUTER_TOKENIZE, n.ROUTER_ROUTE, n.ROUTER_DISPATCH):
        assert spans[name].parent.span_id == g.context.span_id
    # The dispatch span's context is what the worker receives.
    assert md["traceparent"].split("-")[2] == format(d.context.span_id, "016x")
    dispatch_s = (d.end_time - d.start_time) / 1e9
    assert network == pytest.approx(dispatch_s - 0.004, abs=1e-6) and network > 0
    assert d.attributes[n.KVFLEET_NETWORK_S] == network and d.attributes[n.KVFLEET_WORKER_S] == 0.004
    assert float(trailers[n.MD_NETWORK_S]) == pytest.approx(network, abs=1e-6)
    assert trailers[n.MD_TRACE_ID] == format(g.context.trace_id, "032x")
    assert g.attributes[n.GEN_AI_OPERATION_NAME] == "chat"
    assert g.attributes[n.GEN_AI_REQUEST_MAX_TOKENS] == 4 and g.attributes[n.KVFLEET_TENANT] == "acme"
    assert n.GEN_AI_REQUEST_TOP_P not in g.attributes  # defaults are not repeated on every span
    assert g.attributes[n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 32
    assert g.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    r = spans[n.ROUTER_ROUTE].attributes
    assert (r[n.KVFLEET_ROUTE_POLICY], r[n.KVFLEET_REPLICA_ID], r[n.KVFLEET_ROUTE_MATCHED_BLOCKS],
            r[n.KVFLEET_ROUTE_PROMPT_BLOCKS], r[n.KVFLEET_ROUTE_INDEX_USED],
            r[n.KVFLEET_ROUTE_INDEX_SOURCE], r[n.KVFLEET_ROUTE_HOST_BLOCKS]) == (
        "prefix_aware", "replica-b", 3, 5, True, "mirror", 2)
    # Every candidate's inputs, so a surprising choice can be explained from the trace alone.
    assert r[n.KVFLEET_ROUTE_CANDIDATES] == (
        "replica-a matched=1 load=2 (reported=none settled=0 inflight=2)",
        "replica-b matched=3 host=2 load=0 (reported=1 settled=1 inflight=0)")
    assert spans[n.ROUTER_TOKENIZE].attributes[n.GEN_AI_USAGE_INPUT_TOKENS] == 40
    assert router_capture.count(n.METRIC_NETWORK_DURATION) == 1
    assert router_capture.count(n.GEN_AI_SERVER_REQUEST_DURATION) == 1
    assert router_capture.count(n.METRIC_ROUTE_DURATION) == 1


@pytest.mark.parametrize("exc, code, reason", [
    (asyncio.CancelledError, grpc.StatusCode.CANCELLED, "cancelled"),
    (GeneratorExit, grpc.StatusCode.CANCELLED, "cancelled"),
    (KeyError, grpc.StatusCode.INTERNAL, "error"),
])
def test_interrupted_calls_end_every_open_span_with_status(router_capture, exc, code, reason):
    rt = RouterTelemetry(router_capture.telemetry)
    with pytest.raises(exc):
        with rt.request((), "text") as t:
            t.start_dispatch("req-2", "replica-b", "127.0.0.1:9")
            raise exc()
    spans = router_capture.spans()
    for name in (n.ROUTER_GENERATE, n.ROUTER_DISPATCH):
        s = spans[name]
        assert s.status.status_code is StatusCode.ERROR and code.name in s.status.description
        assert s.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == (reason,)
    (point,) = router_capture.points(n.GEN_AI_SERVER_REQUEST_DURATION)
    assert point.attributes[n.ERROR_TYPE] == code.name


def test_an_abort_carries_the_recorded_status(router_capture):
    rt = RouterTelemetry(router_capture.telemetry)
    with pytest.raises(grpc.aio.AbortError):
        with rt.request((), "text") as t:
            t.fail(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1]")
            raise grpc.aio.AbortError()
    (g,) = router_capture.spans().values()
    assert g.attributes[n.RPC_GRPC_STATUS_CODE] == 3 and g.attributes[n.ERROR_TYPE] == "INVALID_ARGUMENT"
    assert g.status.status_code is StatusCode.UNSET  # the caller's mistake, not the server's


def test_disabled_telemetry_records_nothing_but_passes_the_context_on():
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with RouterTelemetry().request((), "text") as t:
        assert not t.recording and t.start_dispatch("r", "x", "a") == ()
    with RouterTelemetry().request([("traceparent", parent)], "text") as t:
        assert not t.recording
        assert t.start_dispatch("r", "x", "a") == (("traceparent", parent),)  # unchanged
        t.on_final(last_message())
        assert t.dispatched([(n.MD_WORKER_DURATION_S, "0.0")]) >= 0  # still measured
        assert dict(t.trailers())[n.MD_TRACE_ID] == parent.split("-")[1]  # the caller's trace
