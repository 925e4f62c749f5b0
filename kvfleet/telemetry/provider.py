"""One process component's tracer and meter, built from a :class:`TelemetryConfig`.

A :class:`Telemetry` is passed explicitly to the services that record (never installed as the
global OpenTelemetry provider), so tests and several components in one process stay apart.
When nothing is configured it hands out OpenTelemetry's no-op tracer and meter: a request then
costs a few no-op calls.

Span times come from this process's monotonic clock (:class:`MonotonicClock`): durations are
monotonic differences, anchored once to the wall clock so spans line up in a trace backend.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvfleet import __version__
from kvfleet.telemetry import names
from kvfleet.telemetry.config import TelemetryConfig

log = logging.getLogger(__name__)

SCOPE = "kvfleet"
# W3C trace context + baggage in gRPC metadata, on every hop.
PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


class MonotonicClock:
    """Monotonic seconds → OpenTelemetry timestamps (ns since the epoch), one anchor per process."""

    def __init__(self) -> None:
        self._wall_ns = time.time_ns()
        self._mono = time.monotonic()

    def wall_ns(self, mono_s: float) -> int:
        return self._wall_ns + round((mono_s - self._mono) * 1e9)

    def now(self) -> float:
        return time.monotonic()


class Telemetry:
    """Tracer + meter (+ their exporters) of one component: ``router``, ``worker``, ``client``.

    Args:
        cfg: what to export where.
        component: names the service (``kvfleet-<component>`` unless ``OTEL_SERVICE_NAME``).
        instance_id: ``service.instance.id`` (the replica id for a worker).
        span_exporter / metric_readers: extra sinks (tests: in-memory), added to the configured.
    """

    def __init__(self, cfg: TelemetryConfig, component: str, instance_id: Optional[str] = None,
                 *, span_exporter=None, metric_readers: Sequence = ()) -> None:
        self.cfg = cfg
        self.component = component
        self.clock = MonotonicClock()
        self.metrics_address: Optional[str] = None  # host:port of the Prometheus endpoint
        self._tracer_provider = None
        self._meter_provider = None
        self._http_server: Any = None  # prometheus_client's WSGI server and its thread
        self._http_thread: Any = None
        resource = None
        if (cfg.tracing_enabled or span_exporter is not None or cfg.metrics_enabled
                or metric_readers):
            resource = _resource(cfg, component, instance_id)
        if cfg.tracing_enabled or span_exporter is not None:
            self._tracer_provider = _tracer_provider(cfg, resource, span_exporter)
            self.tracer = self._tracer_provider.get_tracer(SCOPE, __version__)
        else:
            self.tracer = trace.NoOpTracer()
        readers = list(metric_readers)
        if cfg.otlp_metrics_enabled:
            readers.append(_otlp_metric_reader(cfg))
        if cfg.metrics_port is not None and not cfg.sdk_disabled:
            readers.append(self._prometheus_reader(cfg))
        if readers:
            from opentelemetry.sdk.metrics import MeterProvider

            self._meter_provider = MeterProvider(metric_readers=readers, resource=resource)
            self.meter = self._meter_provider.get_meter(SCOPE, __version__)
        else:
            self.meter = metrics.NoOpMeter(SCOPE)

    @classmethod
    def disabled(cls, component: str = "disabled") -> "Telemetry":
        """No exporter, no-op tracer and meter."""
        return cls(TelemetryConfig(sdk_disabled=True), component)

    @property
    def tracing(self) -> bool:
        return self._tracer_provider is not None

    # ---- trace context over gRPC metadata ---------------------------------------------------
    @staticmethod
    def extract(metadata: Optional[Iterable[tuple[str, str]]]) -> otel_context.Context:
        """The remote parent carried in gRPC (invocation) metadata, if any."""
        carrier: dict[str, str] = {}
        for key, value in metadata or ():
            if key in ("traceparent", "tracestate", "baggage"):
                carrier[key] = value
        return PROPAGATOR.extract(carrier) if carrier else otel_context.Context()

    @staticmethod
    def inject(span, metadata: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
        """``metadata`` plus ``span``'s trace context (unchanged when ``span`` is not sampled)."""
        if not span.get_span_context().is_valid:
            return tuple(metadata)
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return (*metadata, *carrier.items())

    # ---- lifecycle ------------------------------------------------------------------------
    def _prometheus_reader(self, cfg: TelemetryConfig):
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        assert cfg.metrics_port is not None  # only called with a metrics port
        registry = CollectorRegistry(auto_describe=True)
        reader = PrometheusMetricReader(registry=registry)
        try:
            self._http_server, self._http_thread = start_http_server(
                cfg.metrics_port, addr=cfg.metrics_host, registry=registry)
        except OSError as exc:
            raise OSError(f"metrics port {cfg.metrics_host}:{cfg.metrics_port} is not available "
                          f"(pick another with --metrics-port): {exc}") from exc
        self.metrics_address = f"{cfg.metrics_host}:{self._http_server.server_port}"
        return reader

    def force_flush(self, timeout_s: float = 5.0) -> None:
        if self._tracer_provider is not None:
            self._tracer_provider.force_flush(int(timeout_s * 1000))
        if self._meter_provider is not None:
            self._meter_provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop exporters and the Prometheus endpoint (idempotent)."""
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
            self._tracer_provider = None
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
            self._meter_provider = None
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None


def _resource(cfg: TelemetryConfig, component: str, instance_id: Optional[str]):
    from opentelemetry.sdk.resources import Resource

    attrs: dict[str, Any] = dict(cfg.resource_attributes)
    attrs[names.SERVICE_NAME] = cfg.service_name or attrs.get(names.SERVICE_NAME) or f"kvfleet-{component}"
    attrs[names.KVFLEET_COMPONENT] = component
    if instance_id:
        attrs[names.SERVICE_INSTANCE_ID] = instance_id
    attrs.update({"telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry",
                  "service.version": __version__, names.PROCESS_PID: os.getpid()})
    return Resource(attrs)  # explicit: no detector reads this process's environment


def _sampler(cfg: TelemetryConfig):
    from opentelemetry.sdk.trace import sampling

    ratio = 1.0 if cfg.sampler_arg is None else cfg.sampler_arg
    return {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }[cfg.sampler]()


def _tracer_provider(cfg: TelemetryConfig, resource, extra_exporter):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=resource, sampler=_sampler(cfg))
    if extra_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra_exporter))
    if cfg.tracing_enabled:
        if cfg.traces_exporter == "console":
            exporter = ConsoleSpanExporter()
        else:
            endpoint = cfg.traces_endpoint()
            assert endpoint is not None  # tracing_enabled: the console or an endpoint
            exporter = _otlp_exporter(cfg, endpoint, "trace")
        provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=2048, max_export_batch_size=512,
            schedule_delay_millis=cfg.bsp_schedule_delay_s * 1000.0,
            export_timeout_millis=cfg.otlp_timeout_s * 1000.0))
    return provider


def _otlp_metric_reader(cfg: TelemetryConfig):
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    if cfg.metrics_exporter == "console":
        exporter = ConsoleMetricExporter()
    else:
        endpoint = cfg.metrics_endpoint()
        assert endpoint is not None  # otlp_metrics_enabled: the console or an endpoint
        exporter = _otlp_exporter(cfg, endpoint, "metrics")
    return PeriodicExportingMetricReader(
        exporter, export_interval_millis=cfg.metric_export_interval_s * 1000.0,
        export_timeout_millis=cfg.otlp_timeout_s * 1000.0)


def _otlp_exporter(cfg: TelemetryConfig, endpoint: str, signal: str):
    """An OTLP span or metric exporter for ``endpoint`` over the configured protocol."""
    E: Any  # the span or the metric exporter class
    G: Any
    headers: Mapping[str, str] = dict(cfg.otlp_headers)
    if cfg.otlp_protocol == "http/protobuf":
        if signal == "trace":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as E
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as E
        return E(endpoint=endpoint, headers=headers, timeout=cfg.otlp_timeout_s)
    if signal == "trace":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as G
    else:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as G
    return G(endpoint=endpoint, insecure=cfg.insecure_for(endpoint), headers=tuple(headers.items()),
             timeout=cfg.otlp_timeout_s)
