"""The router process's settings, declared once: :class:`RouterConfig`. Its flags are a table
(kvfleet.router.flags); ``kvfleet up`` composes it into its cluster config
(kvfleet.deploy.cluster_config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvfleet import priority
from kvfleet.index_keys import DEFAULT_NAMESPACE
from kvfleet.router.capacity import DEFAULT_RETRY_PUSHBACK_MS
from kvfleet.router.core import PromptLimits
from kvfleet.router.http_front import DEFAULT_MAX_CONNECTIONS
from kvfleet.router.worker_link import DEFAULT_CALL_IDLE_S
from kvfleet.stream_limits import StreamLimits
from kvfleet.telemetry import TelemetryConfig


@dataclass(frozen=True)
class RouterConfig:
    """One router process's settings (its flags: kvfleet.router.flags). Empty ``redis_url``,
    ``model_name``, ``model_dir``: not chosen yet (a cluster config fills them from its
    replicas', kvfleet.deploy.cluster_config); the router needs all three to start.

    Raises:
        ValueError: naming the flag: ``--tls-cert`` without ``--tls-key`` (or the reverse),
            ``priority_admit`` fractions out of (0, 1] or growing towards batch, a
            ``tenant_max_inflight`` or ``http_max_connections`` below 1, ``call_idle_s`` not
            positive, ``shutdown_grace_s`` negative.
    """

    redis_url: str = ""
    model_name: str = ""
    model_dir: str = ""
    block_size: int = 16
    kv_dtype: str = "float32"
    quantization: str = "none"  # the replicas' weights, part of the cache identity
    quant_group_size: int = 32
    host: str = "127.0.0.1"
    port: int = 50051
    # The OpenAI-compatible HTTP front (kvfleet.router.http_front) on this port, same host;
    # None = off, 0 = a free port.
    http_port: Optional[int] = None
    http_max_connections: int = DEFAULT_MAX_CONNECTIONS  # past it the HTTP front answers 503
    policy: str = "predicted_ttft"  # kvfleet.router.policy; why the default: docs/routing.md
    namespace: str = DEFAULT_NAMESPACE
    api_keys_file: Optional[str] = None
    replica_ttl_s: float = 10.0
    # Answer prefix lookups from an in-memory mirror that follows the workers' KV event log
    # (kvfleet.router.index_mirror); False = one Redis round trip per request.
    index_mirror: bool = True
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # OTLP / Prometheus
    log_level: str = "INFO"  # DEBUG adds a line per routing decision
    # The knobs prefix_aware and predicted_ttft share (kvfleet.router.policy):
    # load_penalty_blocks, max_imbalance, popularity_window, kv_saturation, min_excess_load,
    # host_hit_weight; empty = the documented defaults.
    policy_options: dict = field(default_factory=dict)
    retry_pushback_ms: int = DEFAULT_RETRY_PUSHBACK_MS  # RESOURCE_EXHAUSTED's retry hint
    # On SIGTERM/SIGINT: new calls are refused at once, open streams get this long to end.
    shutdown_grace_s: float = 2.0
    tls_cert: Optional[str] = None  # PEM files: serve the client port over TLS
    tls_key: Optional[str] = None
    internal_tls_dir: Optional[str] = None  # mutual TLS to the workers (kvfleet.tls)
    # Slow or vanished readers: messages buffered per stream, seconds a write may wait.
    stream_limits: StreamLimits = field(default_factory=StreamLimits)
    # A worker call with no frame for this long (its replica alive) fails INTERNAL.
    call_idle_s: float = DEFAULT_CALL_IDLE_S
    # What one request may ask to tokenize (bytes, messages, prompts), and the threads doing it.
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    # Per priority class: the fraction of fleet capacity past which its requests are refused
    # (kvfleet.priority.DEFAULT_ADMIT: batch at 80 %, the others at 100 %).
    priority_admit: dict = field(default_factory=lambda: dict(priority.DEFAULT_ADMIT))
    # In-flight requests a tenant without its own key-file limit may hold across every router
    # of the namespace (kvfleet.router.tenant_limits); None = the key file's share only.
    tenant_max_inflight: Optional[int] = None

    def __post_init__(self) -> None:
        priority.check_admit(self.priority_admit, "--priority-admit")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tenant_max_inflight is not None and not (
                isinstance(self.tenant_max_inflight, int) and self.tenant_max_inflight >= 1):
            raise ValueError(f"--tenant-max-inflight must be an integer >= 1, got "
                             f"{self.tenant_max_inflight!r}")
        if self.http_max_connections < 1:
            raise ValueError(f"--http-max-connections must be >= 1, got {self.http_max_connections}")
        if not self.call_idle_s > 0:
            raise ValueError(f"--call-idle-s must be > 0, got {self.call_idle_s}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
