"""Kubernetes manifests for kvfleet under KubeRay, generated from the configuration
``kvfleet up`` runs (``kvfleet k8s render``; the rendered files are in ``deploy/k8s/``).

One source: the pods run a :class:`~kvfleet.deploy.launcher.ClusterConfig` built by
:func:`cluster_config`; the RayService's ``serveConfigV2`` is the Serve config
:func:`kvfleet.deploy.launcher.serve_application` makes of it — the function ``kvfleet up`` applies
locally — and the router Deployment runs :func:`kvfleet.deploy.launcher.router_args` of it,
the command ``kvfleet up`` starts. Objects:

- ``RayService``: a head group without GPUs (``num-cpus: 0``, so no replica lands there) and
  one GPU worker group whose pods hold ``tp`` GPUs each (a replica's ``STRICT_PACK``
  placement group must fit one pod), ``minReplicas``..``maxReplicas`` pods; the in-tree
  autoscaler adds a pod when the Serve config asks for more replicas than the pods hold;
- the router: a Deployment of ``router_replicas`` pods sharing Redis, and its Service;
- Redis (the prefix index and registry; no persistence: replicas republish what they hold);
- an OpenTelemetry Collector receiving every process's OTLP traces and metrics;
- NetworkPolicies: only router pods (and the Ray pods themselves) reach the workers and
  Redis; the Ray dashboard only from its own cluster's pods and the KubeRay operator.

Secure by default: the router requires API keys, Redis a password, router <-> workers mutual
TLS, and the Ray dashboard a token (KubeRay ``authOptions``). The secrets are Kubernetes
Secrets the operator creates (``k8s_objects.SECRETS``, named in :class:`K8sConfig`); the manifests
only reference them by name (mounted files, ``secretKeyRef``), never hold their values, and
the Serve config carries none (the Redis password reaches every process as
``KVFLEET_REDIS_PASSWORD``, kvfleet.secrets).

Worker and router pods get ``terminationGracePeriodSeconds`` above the drain timeout plus
Serve's stop margin, so Kubernetes never kills a pod while a drain may still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfleet.deploy.k8s_objects import (API_KEYS_FILE, API_KEYS_MOUNT, GRPC_PORT, HTTP_PORT,
                                        INTERNAL_TLS_MOUNT, OTLP_GRPC_PORT, REDIS_PORT,
                                        collector, dump, network_policies, ray_service, redis,
                                        router)
from kvfleet.deploy.launcher import ClusterConfig, serve_application
from kvfleet.deploy.models import DEFAULT_MODEL
from kvfleet.deploy.serve_control import deploy_config
from kvfleet.telemetry import TelemetryConfig


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
    dtype: str = "bfloat16"
    drain_timeout_s: float = 30.0
    revision: str = ""  # a new one rolls every replica in place, one at a time
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

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be between 0 and "
                             f"max_replicas ({self.max_replicas})")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be within min_replicas "
                             f"({self.min_replicas}) and max_replicas ({self.max_replicas})")
        if self.tp < 1 or self.router_replicas < 1:
            raise ValueError("tp and router_replicas must be >= 1")

    def service(self, part: str) -> str:
        """The Service (and object) name of ``part`` (``router``, ``redis``, …)."""
        return f"{self.name}-{part}"


def cluster_config(k: K8sConfig) -> ClusterConfig:
    """The ClusterConfig the pods run: the model on the models volume, Redis and the
    collector by Service name, every server bound to all interfaces (replicas advertise their
    pod IP), traces and metrics over OTLP to the collector (no per-process Prometheus
    port: those bind loopback; Prometheus scrapes the collector)."""
    otlp = f"http://{k.service('otel-collector')}:{OTLP_GRPC_PORT}"
    return ClusterConfig(
        api_keys_file=f"{API_KEYS_MOUNT}/{API_KEYS_FILE}", internal_tls_dir=INTERNAL_TLS_MOUNT,
        model_name=k.model_name, model_dir=f"{k.models_mount}/{k.model_name}",
        replicas=k.replicas, kv_memory_bytes=k.kv_memory_bytes, dtype=k.dtype,
        host="0.0.0.0", replica_host="0.0.0.0", port=GRPC_PORT, http_port=HTTP_PORT,
        redis_url=redis_url(k), tensor_parallel_size=k.tp,
        device="cuda", drain_timeout_s=k.drain_timeout_s, revision=k.revision,
        # A router pod told to stop lets its open streams finish as a draining replica does.
        router_args=("--shutdown-grace-s", f"{k.drain_timeout_s:g}"),
        telemetry=TelemetryConfig(otlp_endpoint=otlp, otlp_insecure=True))


def redis_url(k: K8sConfig) -> str:
    """The Redis Service's URL as the pods reach it (the password is not in it: the pods get
    it from the Redis Secret as ``KVFLEET_REDIS_PASSWORD``)."""
    return f"redis://{k.service('redis')}:{REDIS_PORT}/0"


def serve_config(k: K8sConfig, cfg: ClusterConfig) -> dict:
    """The Serve config of the RayService (and of ``serve-config.yaml``): the application
    ``kvfleet up`` would apply for ``cfg``, one CPU for each replica's rank 0 and the pod's
    CPUs shared out as torch threads over its ranks."""
    app = serve_application(cfg, cfg.redis_url, num_cpus=1.0, threads=max(1, k.worker_cpus // k.tp))
    return deploy_config([app])


def render(k: K8sConfig) -> dict[str, list[dict]]:
    """File name → the objects it holds (``rayservice.yaml``, ``router.yaml``, ``redis.yaml``,
    ``otel-collector.yaml``, and ``serve/serve-config.yaml``: the Serve config alone, for
    ``serve run`` / ``serve deploy`` outside Kubernetes; in a subdirectory, so ``kubectl
    apply -f deploy/k8s/`` takes only Kubernetes objects)."""
    cfg = cluster_config(k)
    serve = serve_config(k, cfg)
    return {
        "rayservice.yaml": [ray_service(k, cfg, serve)],
        "serve/serve-config.yaml": [serve],
        "router.yaml": router(k, cfg),
        "redis.yaml": redis(k),
        "otel-collector.yaml": collector(k),
        "network-policy.yaml": network_policies(k),
    }


def write(k: K8sConfig, out_dir: str | Path) -> list[Path]:
    """Render into ``out_dir`` (created); returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in render(k).items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump(objects, header="# Generated by `kvfleet k8s render`: "
                                             "edit the flags, not this file.\n"))
        written.append(path)
    return written
