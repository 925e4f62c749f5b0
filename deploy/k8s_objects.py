"""The Kubernetes objects of a kvfleet deployment (see kvfleet.deploy.k8s, which renders
them from one K8sConfig and the ClusterConfig its pods run): builders returning plain dicts,
one per object kind and part."""

from __future__ import annotations

import yaml
from kvfleet.deploy.cluster_config import ClusterConfig, router_args
from kvfleet.deploy.k8s_config import (
    COLLECTOR_HEALTH_PORT,
    COLLECTOR_PROMETHEUS_PORT,
    GRPC_PORT,
    HTTP_PORT,
    OTLP_GRPC_PORT,
    OTLP_HTTP_PORT,
    REDIS_PORT,
    TERMINATION_MARGIN_S,
    K8sConfig,
)
from kvfleet.deploy.serve_app import SHUTDOWN_MARGIN_S


def grace_period_s(cfg: ClusterConfig) -> int:
    """terminationGracePeriodSeconds for pods that drain: the drain, Serve's stop margin and
    process exit."""
    return int(cfg.replica.drain_timeout_s + SHUTDOWN_MARGIN_S + TERMINATION_MARGIN_S)


def ray_service(k: K8sConfig, cfg: ClusterConfig, serve: dict) -> dict:
    """The ``RayService``: ``serve`` (a whole Serve config) as its ``serveConfigV2``, a head
    group that takes no replica, one worker group of ``k.tp`` GPUs per pod."""
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
    """[Deployment, Service] of the routers: ``python -m kvfleet.router.main`` with
    ``router_args`` of the pods' router config, gRPC health probes, the models volume (the
    router hashes with the model's tokenizer and weight fingerprint)."""
    name = k.service("router")
    labels = {"app.kubernetes.io/name": k.name, "app.kubernetes.io/component": "router"}
    assert cfg.replica.redis_url, "the pods' config names the Redis Service"
    args = router_args(cfg.router_config(cfg.replica.redis_url))
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
    """[Deployment, Service] of the Redis holding the prefix index and registry."""
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
    """[ConfigMap, Deployment, Service] of the OpenTelemetry Collector (see
    :func:`collector_config`)."""
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
    return [{"name": n, "value": v} for n, v in sorted(cfg.replica.telemetry.to_env().items())]


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
    """One YAML document (no ``---``)."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)
