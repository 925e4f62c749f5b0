"""A minimal in-process OTLP/gRPC receiver (traces + metrics) on a loopback port.

For tests and benchmarks: point ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or a
:class:`TelemetryConfig`) at :attr:`OtlpSink.endpoint`, then read back what every process
exported — decoded into plain :class:`SpanRecord` objects and the latest cumulative metric
points. Not a production collector: it keeps everything in memory.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Optional

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvfleet.telemetry.names import SERVICE_NAME


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class SpanRecord:
    """One exported span, decoded. Ids are lower-case hex; times ns since the epoch."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int           # OTLP SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int    # 0 unset, 1 ok, 2 error
    status_message: str
    events: tuple       # ((name, time_ns, attributes), …)
    resource: dict

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def service(self) -> str:
        return self.resource.get(SERVICE_NAME, "")


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer,
                metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: "OtlpSink") -> None:
        self.sink = sink

    def Export(self, request, context):  # both services name their RPC Export
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.sink._add_spans(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self.sink._add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpSink:
    """``start()`` → serve on ``host:port`` (0 = a free port); ``stop()`` when done."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._raw_spans: list = []    # requests as received; decoded when read (keeps the
        self._raw_metrics: list = []  # receiving side cheap next to what is measured)
        self._spans: list[SpanRecord] = []
        self._points: dict = {}  # (resource key, metric, point attrs key) → (time, point)
        self._server: Optional[grpc.Server] = None
        self.endpoint: Optional[str] = None

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        receiver = _Receiver(self)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, self._server)
        port = self._server.add_insecure_port(f"{self._host}:{self._port}")
        self._server.start()
        self.endpoint = f"http://{self._host}:{port}"
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0)
            self._server = None

    # ---- reading back ---------------------------------------------------------------------
    def spans(self) -> list[SpanRecord]:
        with self._lock:
            raw, self._raw_spans = self._raw_spans, []
        records = [r for request in raw for r in _decode_spans(request)]
        with self._lock:
            self._spans.extend(records)
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._raw_spans.clear()
            self._raw_metrics.clear()
            self._spans.clear()
            self._points.clear()

    def histogram_count(self, name: str, **match) -> int:
        """Observations in histogram ``name`` (latest cumulative point per series), summed over
        series whose resource or point attributes include ``match`` (dots as ``__``)."""
        return int(sum(p.count for p in self._series(name, match)))

    def metric_values(self, name: str, **match) -> list[float]:
        """Latest value per series of a sum or gauge ``name``."""
        return [p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
                for p in self._series(name, match)]

    def _series(self, name: str, match: dict) -> list:
        want = {k.replace("__", "."): v for k, v in match.items()}
        with self._lock:
            raw, self._raw_metrics = self._raw_metrics, []
            for request in raw:
                self._decode_metrics(request)
            items = [(res, attrs, p) for (res, metric, attrs), (_, p) in self._points.items()
                     if metric == name]
        out = []
        for res, attrs, point in items:
            merged = {**dict(res), **dict(attrs)}
            if all(merged.get(k) == v for k, v in want.items()):
                out.append(point)
        return out

    # ---- receiving ------------------------------------------------------------------------
    def _add_spans(self, request) -> None:
        with self._lock:
            self._raw_spans.append(request)

    def _add_metrics(self, request) -> None:
        with self._lock:
            self._raw_metrics.append(request)

    def _decode_metrics(self, request) -> None:  # called with the lock held
        for rm in request.resource_metrics:
            res = tuple(sorted((k, str(v)) for k, v in _attrs(rm.resource.attributes).items()))
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in getattr(m, m.WhichOneof("data")).data_points:
                        key = (res, m.name, tuple(sorted(_attrs(p.attributes).items())))
                        old = self._points.get(key)
                        if old is None or p.time_unix_nano >= old[0]:
                            self._points[key] = (p.time_unix_nano, p)


def _decode_spans(request) -> list[SpanRecord]:
    records = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                records.append(SpanRecord(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes=_attrs(s.attributes), status_code=s.status.code,
                    status_message=s.status.message,
                    events=tuple((e.name, e.time_unix_nano, _attrs(e.attributes))
                                 for e in s.events),
                    resource=resource))
    return records
