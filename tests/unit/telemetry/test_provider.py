"""Telemetry: no-op when unconfigured, W3C context over gRPC metadata, Prometheus endpoint."""

from __future__ import annotations

import time
import urllib.request

import pytest
from opentelemetry import trace

from kvfleet.telemetry import Telemetry, TelemetryConfig
from kvfleet.telemetry import names as n
from kvfleet.telemetry.provider import MonotonicClock


def test_unconfigured_telemetry_is_a_no_op():
    tel = Telemetry(TelemetryConfig(), "router")
    assert not tel.tracing and isinstance(tel.tracer, trace.NoOpTracer)
    span = tel.tracer.start_span("x")
    assert not span.is_recording()
    assert tel.inject(span, (("authorization", "k"),)) == (("authorization", "k"),)
    tel.shutdown()


def test_context_round_trips_through_grpc_metadata(worker_capture):
    tel = worker_capture.telemetry
    parent = tel.tracer.start_span("parent")
    md = tel.inject(parent, (("authorization", "Bearer k"),))
    assert md[0] == ("authorization", "Bearer k") and md[1][0] == "traceparent"
    child = tel.tracer.start_span("child", context=tel.extract(md))
    assert child.parent.span_id == parent.get_span_context().span_id
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    assert tel.extract([("authorization", "x")]) == {}  # no carrier: no parent


def test_sampler_from_config_is_honoured():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    out = InMemorySpanExporter()
    tel = Telemetry(TelemetryConfig(sampler="traceidratio", sampler_arg=0.0), "router",
                    span_exporter=out)
    tel.tracer.start_span("dropped").end()
    assert out.get_finished_spans() == ()
    tel.shutdown()


def test_resource_names_the_component_and_instance(worker_capture):
    worker_capture.telemetry.tracer.start_span("x").end()
    (span,) = worker_capture.spans_out.get_finished_spans()
    attrs = span.resource.attributes
    assert attrs[n.SERVICE_NAME] == "kvfleet-worker" and attrs[n.KVFLEET_COMPONENT] == "worker"
    assert attrs[n.SERVICE_INSTANCE_ID] == "test-instance" and attrs[n.PROCESS_PID] > 0


def test_prometheus_endpoint_serves_the_metrics():
    tel = Telemetry(TelemetryConfig(metrics_port=0), "router")
    try:
        assert tel.metrics_address and not tel.tracing
        h = tel.meter.create_histogram(n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, unit="s",
                                       explicit_bucket_boundaries_advisory=n.TTFT_BUCKETS_S)
        h.record(0.03, {n.GEN_AI_REQUEST_MODEL: "tiny"})
        text = urllib.request.urlopen(f"http://{tel.metrics_address}/metrics", timeout=5).read().decode()
        assert 'gen_ai_server_time_to_first_token_seconds_count{gen_ai_request_model="tiny"' in text
        assert 'le="0.04"' in text  # the GenAI bucket advice, not the millisecond defaults
        with pytest.raises(OSError, match="metrics port"):
            Telemetry(TelemetryConfig(metrics_port=int(tel.metrics_address.rsplit(":", 1)[1])),
                      "worker")
    finally:
        tel.shutdown()


def test_monotonic_clock_maps_to_wall_time():
    clock = MonotonicClock()
    now = time.monotonic()
    assert abs(clock.wall_ns(now) - time.time_ns()) < 50_000_000
    assert clock.wall_ns(now + 1.5) - clock.wall_ns(now) == 1_500_000_000
