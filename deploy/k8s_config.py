"""What an operator chooses for a Kubernetes deployment of kvfleet (``kvfleet k8s render``'s
flags) and the ports its objects use. kvfleet.deploy.k8s turns it into the ClusterConfig the
pods run; kvfleet.deploy.k8s_objects builds the objects."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from kvfleet.deploy.autoscale_serve import AutoscaleConfig
from kvfleet.deploy.models import DEFAULT_MODEL
from kvfleet.worker.replica.replica import ReplicaConfig

GRPC_PORT = 50051
HTTP_PORT = 8000
REDIS_PORT = 6379
OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318
COLLECTOR_PROMETHEUS_PORT = 8889
COLLECTOR_HEALTH_PORT = 13133
TERMINATION_MARGIN_S = 15  # beyond Serve's graceful_shutdown_timeout_s: process exit
DASHBOARD_PORT = 8265
_REPLICA_DEFAULTS: dict = {f.name: f.default for f in fields(ReplicaConfig)}


@dataclass(frozen=True)
class K8sConfig:
    """What an operator chooses for a Kubernetes deployment. Sizes are Kubernetes quantities
    (``"16Gi"``); ``tp``: GPUs per worker pod = tensor-parallel ranks per replica."""

    name: str = "kvfleet"
    image: str = "kvfleet:0.1.0"
    model_name: str = DEFAULT_MODEL
    models_claim: str = "kvfleet-models"  # a ReadOnlyMany PVC holding <model_name>/ dirs
    models_mount: str = "/models"
    tp: int = 1
    replicas: int = 2          # Serve replicas (= worker pods: one replica per pod)
    min_replicas: int = 1      # worker pods the autoscaler keeps
    max_replicas: int = 4      # worker pods the autoscaler may add
    router_replicas: int = 2
    worker_cpus: int = 8
    worker_memory: str = "32Gi"
    head_cpus: int = 2
    head_memory: str = "8Gi"
    router_cpus: int = 2
    router_memory: str = "2Gi"
    kv_memory_bytes: int = 8 << 30  # per rank
    kv_host_memory_bytes: Optional[int] = None  # the node's host KV tier (None: none)
    kv_prewarm_s: float = 0.0  # a new replica's pre-warm from the node tier (0: off)
    # Write-back bytes a rank queues for the node tier at once; bytes of one put (a run).
    kv_write_back_queue_bytes: int = _REPLICA_DEFAULTS["kv_write_back_queue_bytes"]
    kv_write_back_run_bytes: int = _REPLICA_DEFAULTS["kv_write_back_run_bytes"]
    dtype: str = "bfloat16"
    drain_timeout_s: float = _REPLICA_DEFAULTS["drain_timeout_s"]  # the replica's own default
    revision: str = ""  # a new one rolls every replica in place, one at a time
    itl_target_ms: Optional[float] = None  # the replicas' ITL target (None: token budget alone)
    ray_version: str = "2.60.0"
    redis_image: str = "redis:7.2"
    collector_image: str = "otel/opentelemetry-collector-contrib:0.120.0"
    traces_endpoint: str = "jaeger-collector:4317"  # where the collector sends traces (OTLP)
    # Secrets the operator creates (k8s_objects.SECRETS: their keys); referenced by name only.
    api_keys_secret: str = "kvfleet-api-keys"
    redis_secret: str = "kvfleet-redis"
    internal_tls_secret: str = "kvfleet-internal-tls"
    otlp_headers_secret: str = "kvfleet-otlp"  # optional: OTLP headers (a collector's token)
    # Pods of the KubeRay operator (any namespace), the one caller of the Ray dashboard.
    operator_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "kuberay-operator"),)
    # Serve scales the replicas with kvfleet's policy (--autoscale MIN..MAX): the Serve config
    # carries it, and the worker group's pods follow (one replica per pod, MIN..MAX pods).
    autoscale: Optional[AutoscaleConfig] = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be between 0 and "
                             f"max_replicas ({self.max_replicas})")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be within min_replicas "
                             f"({self.min_replicas}) and max_replicas ({self.max_replicas})")
        a = self.autoscale
        if a is not None and (self.replicas, self.min_replicas, self.max_replicas) != (
                a.targets.min_replicas, a.targets.min_replicas, a.targets.max_replicas):
            raise ValueError("with --autoscale MIN..MAX the replicas start at MIN and the worker "
                             "pods range over MIN..MAX: leave --replicas, --min-replicas and "
                             "--max-replicas unset")
        if self.tp < 1 or self.router_replicas < 1:
            raise ValueError("tp and router_replicas must be >= 1")
        if self.itl_target_ms is not None and not 0 < self.itl_target_ms < float("inf"):
            raise ValueError(f"--itl-target-ms must be > 0, got {self.itl_target_ms}")

    def service(self, part: str) -> str:
        """The Service (and object) name of ``part`` (``router``, ``redis``, …)."""
        return f"{self.name}-{part}"
