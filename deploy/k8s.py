"""Kubernetes manifests for kvfleet under KubeRay, generated from the configuration
``kvfleet up`` runs (``kvfleet k8s render``; the rendered files are in ``deploy/k8s/``).

One source: the pods run a :class:`~kvfleet.deploy.cluster_config.ClusterConfig` built by
:func:`cluster_config`; the RayService's ``serveConfigV2`` is the Serve config
:func:`kvfleet.deploy.cluster_config.serve_application` makes of it — the function ``kvfleet up``
applies locally — and the router Deployment runs
:func:`kvfleet.deploy.cluster_config.router_args` of it,
the command ``kvfleet up`` starts. Objects:

- ``RayService``: a head group without GPUs (``num-cpus: 0``, so no replica lands there) and
  one GPU worker group whose pods hold ``tp`` GPUs each (a replica's ``STRICT_PACK``
  placement group must fit one pod), ``minReplicas``..``maxReplicas`` pods; the in-tree
  autoscaler adds a pod when the Serve config asks for more replicas than the pods hold
  (with ``--autoscale`` Serve itself moves that count with kvfleet's policy, and the pods
  follow it over MIN..MAX);
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

from pathlib import Path

from kvfleet.deploy.cluster_config import ClusterConfig, serve_application
from kvfleet.deploy.k8s_config import GRPC_PORT, HTTP_PORT, OTLP_GRPC_PORT, REDIS_PORT, K8sConfig
from kvfleet.deploy.k8s_objects import (
    API_KEYS_FILE,
    API_KEYS_MOUNT,
    INTERNAL_TLS_MOUNT,
    collector,
    dump,
    network_policies,
    ray_service,
    redis,
    router,
)
from kvfleet.deploy.serve_control import deploy_config
from kvfleet.router.config import RouterConfig
from kvfleet.telemetry import TelemetryConfig
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.replica.replica import ReplicaConfig

__all__ = ["GRPC_PORT", "HTTP_PORT", "REDIS_PORT", "K8sConfig", "cluster_config", "render",
           "serve_config", "write"]


def cluster_config(k: K8sConfig) -> ClusterConfig:
    """The ClusterConfig the pods run: the model on the models volume, Redis and the
    collector by Service name, every server bound to all interfaces (replicas advertise their
    pod IP), traces and metrics over OTLP to the collector (no per-process Prometheus
    port: those bind loopback; Prometheus scrapes the collector)."""
    otlp = f"http://{k.service('otel-collector')}:{OTLP_GRPC_PORT}"
    replica = ReplicaConfig(
        replica_id=k.model_name, model_name=k.model_name,
        model_dir=f"{k.models_mount}/{k.model_name}", kv_memory_bytes=k.kv_memory_bytes,
        kv_host_memory_bytes=k.kv_host_memory_bytes, kv_prewarm_s=k.kv_prewarm_s,
        kv_write_back_queue_bytes=k.kv_write_back_queue_bytes,
        kv_write_back_run_bytes=k.kv_write_back_run_bytes,
        dtype=k.dtype, host="0.0.0.0", redis_url=redis_url(k), tensor_parallel_size=k.tp,
        device="cuda", drain_timeout_s=k.drain_timeout_s, internal_tls_dir=INTERNAL_TLS_MOUNT,
        scheduler=SchedulerConfig(itl_target_ms=k.itl_target_ms),
        telemetry=TelemetryConfig(otlp_endpoint=otlp, otlp_insecure=True))
    # A router pod told to stop lets its open streams finish as a draining replica does.
    router = RouterConfig(host="0.0.0.0", port=GRPC_PORT, http_port=HTTP_PORT,
                          shutdown_grace_s=k.drain_timeout_s,
                          api_keys_file=f"{API_KEYS_MOUNT}/{API_KEYS_FILE}")
    return ClusterConfig(replica, router, replicas=k.replicas, revision=k.revision,
                         autoscale=k.autoscale)


def redis_url(k: K8sConfig) -> str:
    """The Redis Service's URL as the pods reach it (the password is not in it: the pods get
    it from the Redis Secret as ``KVFLEET_REDIS_PASSWORD``)."""
    return f"redis://{k.service('redis')}:{REDIS_PORT}/0"


def serve_config(k: K8sConfig, cfg: ClusterConfig) -> dict:
    """The Serve config of the RayService (and of ``serve-config.yaml``): the application
    ``kvfleet up`` would apply for ``cfg``, one CPU for each replica's rank 0 and the pod's
    CPUs shared out as torch threads over its ranks."""
    app = serve_application(cfg, redis_url(k), num_cpus=1.0, threads=max(1, k.worker_cpus // k.tp))
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
