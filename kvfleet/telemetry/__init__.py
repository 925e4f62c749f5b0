"""kvfleet's OpenTelemetry tracing and metrics, in one package (STYLE.md practice 9).

* :mod:`~kvfleet.telemetry.names` — every span, attribute, metric and metadata name, once.
* :mod:`~kvfleet.telemetry.config` — :class:`TelemetryConfig` from the standard ``OTEL_*`` vars.
* :mod:`~kvfleet.telemetry.provider` — :class:`Telemetry`: tracer, meter, exporters, propagation.
* :mod:`~kvfleet.telemetry.router_spans` / :mod:`~kvfleet.telemetry.worker_spans` /
  :mod:`~kvfleet.telemetry.client_spans` — what each hop records for one request.
"""

from kvfleet.telemetry.config import TelemetryConfig
from kvfleet.telemetry.provider import Telemetry

__all__ = ["Telemetry", "TelemetryConfig"]
