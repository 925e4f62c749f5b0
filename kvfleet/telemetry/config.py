"""Telemetry configuration: the standard ``OTEL_*`` environment variables, read once, explicitly.

Nothing here reads the environment at import time. A process entry point calls
:meth:`TelemetryConfig.from_env` with ``os.environ`` and passes the frozen result down (to a
Ray actor, too, where the driver's environment may not exist); :meth:`to_env` turns it back
into variables for a child process.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")

DEFAULT_BSP_SCHEDULE_DELAY_S = 5.0
DEFAULT_METRIC_EXPORT_INTERVAL_S = 60.0
DEFAULT_OTLP_TIMEOUT_S = 10.0
DEFAULT_METRICS_HOST = "127.0.0.1"


def _pairs(raw: str, what: str) -> tuple[tuple[str, str], ...]:
    """``k1=v1,k2=v2`` (values URL-decoded, as the OTel spec says) → pairs."""
    out = []
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: expected key=value pairs, got {item!r}")
        out.append((key.strip(), urllib.parse.unquote(value.strip())))
    return tuple(out)


def _ms(env: Mapping[str, str], name: str, default_s: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default_s
    try:
        value = float(raw) / 1000.0
    except ValueError:
        raise ValueError(f"{name} must be a number of milliseconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {raw!r}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices``; a comma-separated list (the exporter variables allow one) → its first."""
    value = env.get(name, "").split(",")[0].strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _bool(env: Mapping[str, str], name: str) -> Optional[bool]:
    raw = env.get(name, "").strip().lower()
    return None if not raw else raw == "true"


@dataclass(frozen=True)
class TelemetryConfig:
    """Where and how one kvfleet process exports traces and metrics.

    Traces are exported over OTLP only when an OTLP endpoint is configured (or to stdout with
    ``OTEL_TRACES_EXPORTER=console``); metrics over OTLP likewise, and on a Prometheus
    endpoint when ``metrics_port`` is set (``--metrics-port``; 0 = a free port).
    """

    service_name: Optional[str] = None                  # OTEL_SERVICE_NAME
    resource_attributes: tuple[tuple[str, str], ...] = ()  # OTEL_RESOURCE_ATTRIBUTES
    traces_exporter: str = "otlp"                       # OTEL_TRACES_EXPORTER
    metrics_exporter: str = "otlp"                      # OTEL_METRICS_EXPORTER
    otlp_endpoint: Optional[str] = None                 # OTEL_EXPORTER_OTLP_ENDPOINT
    otlp_traces_endpoint: Optional[str] = None          # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    otlp_metrics_endpoint: Optional[str] = None         # OTEL_EXPORTER_OTLP_METRICS_ENDPOINT
    otlp_protocol: str = "grpc"                         # OTEL_EXPORTER_OTLP_PROTOCOL
    otlp_headers: tuple[tuple[str, str], ...] = ()      # OTEL_EXPORTER_OTLP_HEADERS
    otlp_insecure: Optional[bool] = None                # OTEL_EXPORTER_OTLP_INSECURE
    otlp_timeout_s: float = DEFAULT_OTLP_TIMEOUT_S      # OTEL_EXPORTER_OTLP_TIMEOUT (ms)
    sampler: str = "parentbased_always_on"              # OTEL_TRACES_SAMPLER
    sampler_arg: Optional[float] = None                 # OTEL_TRACES_SAMPLER_ARG
    bsp_schedule_delay_s: float = DEFAULT_BSP_SCHEDULE_DELAY_S  # OTEL_BSP_SCHEDULE_DELAY (ms)
    metric_export_interval_s: float = DEFAULT_METRIC_EXPORT_INTERVAL_S  # OTEL_METRIC_EXPORT_INTERVAL
    sdk_disabled: bool = False                          # OTEL_SDK_DISABLED
    metrics_port: Optional[int] = None                  # --metrics-port (not an OTel variable)
    metrics_host: str = DEFAULT_METRICS_HOST
    extra_env: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # other OTEL_*

    def __post_init__(self) -> None:
        for name, value, choices in (("traces_exporter", self.traces_exporter, EXPORTERS),
                                     ("metrics_exporter", self.metrics_exporter, EXPORTERS),
                                     ("otlp_protocol", self.otlp_protocol, PROTOCOLS),
                                     ("sampler", self.sampler, SAMPLERS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.metrics_port}")

    # ---- environment ---------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides) -> "TelemetryConfig":
        """Read the standard OTel variables from ``env``. Raises ValueError on a bad value."""
        sampler_arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        known = {"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER",
                 "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS",
                 "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TIMEOUT",
                 "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_BSP_SCHEDULE_DELAY",
                 "OTEL_METRIC_EXPORT_INTERVAL", "OTEL_SDK_DISABLED"}
        cfg = cls(
            service_name=env.get("OTEL_SERVICE_NAME", "").strip() or None,
            resource_attributes=_pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""),
                                       "OTEL_RESOURCE_ATTRIBUTES"),
            traces_exporter=_choice(env, "OTEL_TRACES_EXPORTER", EXPORTERS, "otlp"),
            metrics_exporter=_choice(env, "OTEL_METRICS_EXPORTER", EXPORTERS, "otlp"),
            otlp_endpoint=env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or None,
            otlp_traces_endpoint=env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or None,
            otlp_metrics_endpoint=env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip() or None,
            otlp_protocol=_choice(env, "OTEL_EXPORTER_OTLP_PROTOCOL", PROTOCOLS, "grpc"),
            otlp_headers=_pairs(env.get("OTEL_EXPORTER_OTLP_HEADERS", ""),
                                "OTEL_EXPORTER_OTLP_HEADERS"),
            otlp_insecure=_bool(env, "OTEL_EXPORTER_OTLP_INSECURE"),
            otlp_timeout_s=_ms(env, "OTEL_EXPORTER_OTLP_TIMEOUT", DEFAULT_OTLP_TIMEOUT_S),
            sampler=_choice(env, "OTEL_TRACES_SAMPLER", SAMPLERS, "parentbased_always_on"),
            sampler_arg=float(sampler_arg) if sampler_arg else None,
            bsp_schedule_delay_s=_ms(env, "OTEL_BSP_SCHEDULE_DELAY", DEFAULT_BSP_SCHEDULE_DELAY_S),
            metric_export_interval_s=_ms(env, "OTEL_METRIC_EXPORT_INTERVAL",
                                         DEFAULT_METRIC_EXPORT_INTERVAL_S),
            sdk_disabled=_bool(env, "OTEL_SDK_DISABLED") is True,
            extra_env=tuple(sorted((k, v) for k, v in env.items()
                                   if k.startswith("OTEL_") and k not in known)),
        )
        return replace(cfg, **overrides) if overrides else cfg

    def to_env(self) -> dict[str, str]:
        """The ``OTEL_*`` variables that :meth:`from_env` reads back into this config."""
        env = dict(self.extra_env)
        put = env.__setitem__
        if self.service_name:
            put("OTEL_SERVICE_NAME", self.service_name)
        if self.resource_attributes:
            put("OTEL_RESOURCE_ATTRIBUTES", ",".join(
                f"{k}={urllib.parse.quote(v, safe='')}" for k, v in self.resource_attributes))
        put("OTEL_TRACES_EXPORTER", self.traces_exporter)
        put("OTEL_METRICS_EXPORTER", self.metrics_exporter)
        for name, value in (("OTEL_EXPORTER_OTLP_ENDPOINT", self.otlp_endpoint),
                            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", self.otlp_traces_endpoint),
                            ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", self.otlp_metrics_endpoint)):
            if value:
                put(name, value)
        put("OTEL_EXPORTER_OTLP_PROTOCOL", self.otlp_protocol)
        if self.otlp_headers:
            put("OTEL_EXPORTER_OTLP_HEADERS", ",".join(
                f"{k}={urllib.parse.quote(v, safe='')}" for k, v in self.otlp_headers))
        if self.otlp_insecure is not None:
            put("OTEL_EXPORTER_OTLP_INSECURE", str(self.otlp_insecure).lower())
        put("OTEL_EXPORTER_OTLP_TIMEOUT", _fmt_ms(self.otlp_timeout_s))
        put("OTEL_TRACES_SAMPLER", self.sampler)
        if self.sampler_arg is not None:
            put("OTEL_TRACES_SAMPLER_ARG", repr(self.sampler_arg))
        put("OTEL_BSP_SCHEDULE_DELAY", _fmt_ms(self.bsp_schedule_delay_s))
        put("OTEL_METRIC_EXPORT_INTERVAL", _fmt_ms(self.metric_export_interval_s))
        if self.sdk_disabled:
            put("OTEL_SDK_DISABLED", "true")
        return env

    # ---- what is on ---------------------------------------------------------------------
    def traces_endpoint(self) -> Optional[str]:
        """The OTLP traces endpoint (per-signal variable first), or None."""
        return self._endpoint(self.otlp_traces_endpoint, "v1/traces")

    def metrics_endpoint(self) -> Optional[str]:
        return self._endpoint(self.otlp_metrics_endpoint, "v1/metrics")

    def _endpoint(self, specific: Optional[str], http_path: str) -> Optional[str]:
        if specific:
            return specific
        if not self.otlp_endpoint:
            return None
        if self.otlp_protocol == "http/protobuf":  # the generic endpoint is a base URL
            return self.otlp_endpoint.rstrip("/") + "/" + http_path
        return self.otlp_endpoint

    @property
    def tracing_enabled(self) -> bool:
        if self.sdk_disabled or self.traces_exporter == "none":
            return False
        return self.traces_exporter == "console" or self.traces_endpoint() is not None

    @property
    def exports_to_stdout(self) -> bool:
        """Spans or metrics are printed on each process's stdout (a ``console`` exporter): a
        launcher must forward its children's stdout or they are lost."""
        return not self.sdk_disabled and "console" in (self.traces_exporter,
                                                       self.metrics_exporter)

    @property
    def otlp_metrics_enabled(self) -> bool:
        if self.sdk_disabled or self.metrics_exporter == "none":
            return False
        return self.metrics_exporter == "console" or self.metrics_endpoint() is not None

    @property
    def metrics_enabled(self) -> bool:
        return self.otlp_metrics_enabled or (self.metrics_port is not None and not self.sdk_disabled)

    def insecure_for(self, endpoint: str) -> bool:
        """gRPC transport security: the explicit setting, else plaintext unless ``https://``."""
        if self.otlp_insecure is not None:
            return self.otlp_insecure
        return urllib.parse.urlparse(endpoint).scheme != "https"


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1000.0
    return str(int(ms)) if ms == int(ms) else repr(ms)
