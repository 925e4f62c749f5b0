"""TelemetryConfig: the standard OTEL_* variables, read explicitly, round-tripped for children."""

from __future__ import annotations

import pytest

from kvfleet.telemetry import TelemetryConfig


def test_nothing_configured_means_nothing_exported():
    cfg = TelemetryConfig.from_env({})
    assert cfg == TelemetryConfig()
    assert not cfg.tracing_enabled and not cfg.metrics_enabled


def test_otlp_endpoint_turns_on_traces_and_metrics():
    cfg = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert cfg.tracing_enabled and cfg.otlp_metrics_enabled
    assert cfg.traces_endpoint() == cfg.metrics_endpoint() == "http://collector:4317"
    assert cfg.insecure_for(cfg.traces_endpoint())
    assert not cfg.insecure_for("https://collector:4317")


def test_per_signal_endpoints_and_http_paths():
    cfg = TelemetryConfig.from_env({
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:9000/custom"})
    assert cfg.traces_endpoint() == "http://c:4318/v1/traces"  # the generic one is a base URL
    assert cfg.metrics_endpoint() == "http://m:9000/custom"    # a per-signal one is used as is


@pytest.mark.parametrize("env, traces, metrics", [
    ({"OTEL_SDK_DISABLED": "true"}, False, False),
    ({"OTEL_TRACES_EXPORTER": "none"}, False, True),
    ({"OTEL_METRICS_EXPORTER": "none"}, True, False),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, True, True),  # a list: the first counts
])
def test_exporter_switches(env, traces, metrics):
    cfg = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", **env})
    assert cfg.tracing_enabled is traces and cfg.otlp_metrics_enabled is metrics


def test_every_field_parsed_and_round_tripped_through_the_environment():
    env = {"OTEL_SERVICE_NAME": "edge", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=a%2Cb",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317", "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "1500",
           "OTEL_PROPAGATORS": "tracecontext", "UNRELATED": "x"}
    cfg = TelemetryConfig.from_env(env)
    assert cfg.service_name == "edge"
    assert cfg.resource_attributes == (("deployment.environment", "prod"), ("team", "a,b"))
    assert cfg.otlp_headers == (("api-key", "s=cret"),)
    assert cfg.otlp_insecure is True and cfg.insecure_for("https://c:4317")
    assert cfg.otlp_timeout_s == 2.5 and cfg.bsp_schedule_delay_s == 0.1
    assert cfg.metric_export_interval_s == 1.5
    assert cfg.sampler == "parentbased_traceidratio" and cfg.sampler_arg == 0.25
    assert cfg.extra_env == (("OTEL_PROPAGATORS", "tracecontext"),)
    back = cfg.to_env()
    assert "UNRELATED" not in back and back["OTEL_PROPAGATORS"] == "tracecontext"
    assert TelemetryConfig.from_env(back) == cfg


@pytest.mark.parametrize("env, word", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "OTEL_RESOURCE_ATTRIBUTES"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
])
def test_bad_values_are_named(env, word):
    with pytest.raises(ValueError, match=word):
        TelemetryConfig.from_env(env)


def test_metrics_port_alone_enables_metrics_only():
    cfg = TelemetryConfig.from_env({}, metrics_port=0)
    assert cfg.metrics_enabled and not cfg.tracing_enabled and not cfg.otlp_metrics_enabled
    with pytest.raises(ValueError, match="metrics port"):
        TelemetryConfig(metrics_port=70000)


@pytest.mark.parametrize("env, printed", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_METRICS_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
])
def test_console_export_is_known_so_launchers_forward_stdout(env, printed):
    # kvfleet up starts Ray with log_to_driver exactly when this holds (replicas' spans on
    # their stdout would otherwise stay in Ray's session logs, deleted at shutdown).
    assert TelemetryConfig.from_env(env).exports_to_stdout is printed
