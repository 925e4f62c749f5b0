"""In-memory sinks for telemetry unit tests (docs/design.md §6: tests use the in-memory exporter)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvfleet.telemetry import Telemetry, TelemetryConfig


class Captured:
    def __init__(self, component: str) -> None:
        self.spans_out = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.telemetry = Telemetry(TelemetryConfig(), component, "test-instance",
                                   span_exporter=self.spans_out, metric_readers=[self.reader])

    def spans(self) -> dict:
        return {s.name: s for s in self.spans_out.get_finished_spans()}

    def points(self, metric: str) -> list:
        data = self.reader.get_metrics_data()
        out = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == metric:
                        out += list(m.data.data_points)
        return out

    def count(self, metric: str) -> int:
        return sum(p.count for p in self.points(metric))


@pytest.fixture
def worker_capture():
    c = Captured("worker")
    yield c
    c.telemetry.shutdown()


@pytest.fixture
def router_capture():
    c = Captured("router")
    yield c
    c.telemetry.shutdown()
