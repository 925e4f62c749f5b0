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
- an OpenTelemetry Collector receiving every process's OTLP traces and metrics.

Worker and router pods get ``terminationGracePeriodSeconds`` above the drain timeout plus
Serve's stop margin, so Kubernetes never kills a pod while a drain may still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from kvfleet.deploy.launcher import ClusterConfig, router_args, serve_application
from kvfleet.deploy.serve_control import deploy_config
from kvfleet.telemetry import TelemetryConfig

GRPC_PORT = 50051
HTTP_PORT = 8000
REDIS_PORT = 6379
OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318
COLLECTOR_PROMETHEUS_PORT = 8889
COLLECTOR_HEALTH_PORT = 13133
TERMINATION_MARGIN_S = 15  # beyond Serve's graceful_shutdown_timeout_s: process exit


@dataclass(frozen=True)
class K8sConfig:
    """What an operator chooses for a Kubernetes deployment. Sizes are Kubernetes quantities
    (``"16Gi"``); ``tp``: GPUs per worker pod = tensor-parallel ranks per replica."""

    name: str = "kvfleet"
    image: str = "kvfleet:0.1.0"
    model_name: str = "smollm2-135m-instruct"
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
        model_name=k.model_name, model_dir=f"{k.models_mount}/{k.model_name}",
        replicas=k.replicas, kv_memory_bytes=k.kv_memory_bytes, dtype=k.dtype,
        host="0.0.0.0", replica_host="0.0.0.0", port=GRPC_PORT, http_port=HTTP_PORT,
        redis_url=redis_url(k), tensor_parallel_size=k.tp,
        device="cuda", drain_timeout_s=k.drain_timeout_s, revision=k.revision,
        # A router pod told to stop lets its open streams finish as a draining replica does.
        router_args=("--shutdown-grace-s", f"{k.drain_timeout_s:g}"),
        telemetry=TelemetryConfig(otlp_endpoint=otlp, otlp_insecure=True))


def redis_url(k: K8sConfig) -> str:
    return f"redis://{k.service('redis')}:{REDIS_PORT}/0"


def grace_period_s(cfg: ClusterConfig) -> int:
    """terminationGracePeriodSeconds for pods that drain: the drain, Serve's stop margin and
    process exit."""
    from kvfleet.deploy.serve_app import SHUTDOWN_MARGIN_S

    return int(cfg.drain_timeout_s + SHUTDOWN_MARGIN_S + TERMINATION_MARGIN_S)


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
    }


def write(k: K8sConfig, out_dir: str | Path) -> list[Path]:
    """Render into ``out_dir`` (created); returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in render(k).items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump(objects, header=f"# Generated by `kvfleet k8s render`: "
                                             f"edit the flags, not this file.\n"))
        written.append(path)
    return written


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the embedded Serve and collector configs stay
    readable), no anchors for objects used twice (labels)."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump(objects: list[dict], header: str = "") -> str:
    """YAML documents, keys in the order built (``kubectl apply -f`` takes the file)."""
    return header + "---\n".join(to_yaml(o) for o in objects)


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)


def ray_service(k: K8sConfig, cfg: ClusterConfig, serve: dict) -> dict:
    labels = {"app.kubernetes.io/name": k.name, "app.kubernetes.io/component": "workers"}
    container = {"image": k.image, "env": _env(cfg)}
    head = {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
            "name": "ray-head", **container,
            "ports": [{"containerPort": 6379, "name": "gcs"},
                      {"containerPort": 8265, "name": "dashboard"},
                      {"containerPort": 10001, "name": "client"}],
            "resources": _resources(k.head_cpus, k.head_memory)}]}},
    }
    worker = {
        "groupName": f"gpu-tp{k.tp}",
        "replicas": k.replicas, "minReplicas": k.min_replicas, "maxReplicas": k.max_replicas,
        "rayStartParams": {},
        "template": {"metadata": {"labels": labels}, "spec": {
            "terminationGracePeriodSeconds": grace_period_s(cfg),
            "containers": [{
                "name": "ray-worker", **container,
                "resources": _resources(k.worker_cpus, k.worker_memory, gpus=k.tp),
                "volumeMounts": [_models_mount(k)]}],
            "volumes": [_models_volume(k)]}},
    }
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": k.name, "labels": {"app.kubernetes.io/name": k.name}},
        "spec": {
            "serveConfigV2": to_yaml(serve),
            "rayClusterConfig": {
                "rayVersion": k.ray_version,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 120},
                "headGroupSpec": head,
                "workerGroupSpecs": [worker],
            },
        },
    }


def router(k: K8sConfig, cfg: ClusterConfig) -> list[dict]:
    name = k.service("router")
    labels = {"app.kubernetes.io/name": k.name, "app.kubernetes.io/component": "router"}
    args = router_args(cfg, cfg.redis_url, cfg.http_port, cfg.metrics_port)
    probe = {"grpc": {"port": GRPC_PORT}, "periodSeconds": 5}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": k.router_replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "terminationGracePeriodSeconds": grace_period_s(cfg),
                "containers": [{
                    "name": "router", "image": k.image,
                    "command": ["python", "-m", "kvfleet.router.main"], "args": args,
                    "env": _env(cfg) + [{"name": "OTEL_SERVICE_NAME", "value": "kvfleet-router"}],
                    "ports": [{"containerPort": GRPC_PORT, "name": "grpc"},
                              {"containerPort": HTTP_PORT, "name": "http"}],
                    "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
                    "resources": _resources(k.router_cpus, k.router_memory),
                    "volumeMounts": [_models_mount(k)]}],
                "volumes": [_models_volume(k)]}},
        },
    }
    return [deployment, _service(name, labels, {"grpc": GRPC_PORT, "http": HTTP_PORT})]


def redis(k: K8sConfig) -> list[dict]:
    name = k.service("redis")
    labels = {"app.kubernetes.io/name": k.name, "app.kubernetes.io/component": "redis"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                     "name": "redis", "image": k.redis_image,
                     # An index, not a store: replicas republish what they hold after a restart.
                     "args": ["--save", "", "--appendonly", "no"],
                     "ports": [{"containerPort": REDIS_PORT, "name": "redis"}],
                     "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
                     "resources": _resources(1, "2Gi")}]}}},
    }
    return [deployment, _service(name, labels, {"redis": REDIS_PORT})]


def collector_config(k: K8sConfig) -> dict:
    """The collector's pipelines: traces to ``k.traces_endpoint`` over OTLP, metrics on a
    Prometheus scrape endpoint (``:8889/metrics``, one series per process)."""
    return {
        "receivers": {"otlp": {"protocols": {
            "grpc": {"endpoint": f"0.0.0.0:{OTLP_GRPC_PORT}"},
            "http": {"endpoint": f"0.0.0.0:{OTLP_HTTP_PORT}"}}}},
        "processors": {"memory_limiter": {"check_interval": "1s", "limit_mib": 512},
                       "batch": {"timeout": "1s"}},
        "exporters": {"otlp/traces": {"endpoint": k.traces_endpoint, "tls": {"insecure": True}},
                      "prometheus": {"endpoint": f"0.0.0.0:{COLLECTOR_PROMETHEUS_PORT}",
                                     "resource_to_telemetry_conversion": {"enabled": True}}},
        "extensions": {"health_check": {"endpoint": f"0.0.0.0:{COLLECTOR_HEALTH_PORT}"}},
        "service": {"extensions": ["health_check"], "pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"],
                       "exporters": ["otlp/traces"]},
            "metrics": {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"],
                        "exporters": ["prometheus"]}}},
    }


def collector(k: K8sConfig) -> list[dict]:
    name = k.service("otel-collector")
    labels = {"app.kubernetes.io/name": k.name, "app.kubernetes.io/component": "otel-collector"}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": name, "labels": labels},
                  "data": {"config.yaml": to_yaml(collector_config(k))}}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "containers": [{
                         "name": "otel-collector", "image": k.collector_image,
                         "args": ["--config=/etc/otelcol/config.yaml"],
                         "ports": [{"containerPort": OTLP_GRPC_PORT, "name": "otlp-grpc"},
                                   {"containerPort": OTLP_HTTP_PORT, "name": "otlp-http"},
                                   {"containerPort": COLLECTOR_PROMETHEUS_PORT, "name": "prometheus"}],
                         "readinessProbe": {"httpGet": {"path": "/", "port": COLLECTOR_HEALTH_PORT}},
                         "resources": _resources(1, "1Gi"),
                         "volumeMounts": [{"name": "config", "mountPath": "/etc/otelcol"}]}],
                     "volumes": [{"name": "config", "configMap": {"name": name}}]}}},
    }
    return [config_map, deployment,
            _service(name, labels, {"otlp-grpc": OTLP_GRPC_PORT, "otlp-http": OTLP_HTTP_PORT,
                                    "prometheus": COLLECTOR_PROMETHEUS_PORT})]


def _env(cfg: ClusterConfig) -> list[dict]:
    return [{"name": n, "value": v} for n, v in sorted(cfg.telemetry.to_env().items())]


def _resources(cpus: int, memory: str, gpus: int = 0) -> dict:
    amounts = {"cpu": str(cpus), "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _models_mount(k: K8sConfig) -> dict:
    return {"name": "models", "mountPath": k.models_mount, "readOnly": True}


def _models_volume(k: K8sConfig) -> dict:
    return {"name": "models", "persistentVolumeClaim": {"claimName": k.models_claim,
                                                        "readOnly": True}}


def _service(name: str, labels: dict, ports: dict[str, int]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
            "spec": {"selector": labels,
                     "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()]}}
