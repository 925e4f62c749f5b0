"""The Kubernetes objects of a kvfleet deployment (see kvfleet.deploy.k8s, which renders
them from one K8sConfig and the ClusterConfig its pods run): builders returning plain dicts,
one per object kind and part."""

from __future__ import annotations

import yaml

from kvfleet.deploy.cluster_config import ClusterConfig, router_args
from kvfleet.deploy.k8s_config import (
    COLLECTOR_HEALTH_PORT,
    COLLECTOR_PROMETHEUS_PORT,
    DASHBOARD_PORT,
    GRPC_PORT,
    HTTP_PORT,
    OTLP_GRPC_PORT,
    OTLP_HTTP_PORT,
    REDIS_PORT,
    TERMINATION_MARGIN_S,
    K8sConfig,
)
from kvfleet.deploy.serve_app import SHUTDOWN_MARGIN_S
from kvfleet.secrets import OTLP_HEADERS_ENV, REDIS_PASSWORD_ENV
from kvfleet.tls import FILES as TLS_FILES
from kvfleet.tls import REPLICA_FILES, ROUTER_FILES, WORKER_FILES

# Secrets: mounted read-only where the processes look for them (files 0440, group = the
# image's ``users`` group through fsGroup: the Ray image runs as ``ray``, gid 100).
API_KEYS_MOUNT = "/etc/kvfleet/api-keys"
API_KEYS_FILE = "keys.json"
INTERNAL_TLS_MOUNT = "/etc/kvfleet/internal-tls"
SECRET_FILE_MODE = 0o440
POD_FS_GROUP = 100
# K8sConfig field naming each Secret → the keys it must hold (create them with
# ``kubectl create secret generic NAME --from-file=…`` / ``--from-literal=…``).
SECRETS = {
    "api_keys_secret": (API_KEYS_FILE,),          # {"keys": {KEY: tenant, ...}} (router)
    "redis_secret": ("password",),                # Redis requirepass; every process's KVFLEET_REDIS_PASSWORD
    "internal_tls_secret": TLS_FILES,             # each pod mounts only its role's items
    "otlp_headers_secret": ("headers",),          # optional: OTEL_EXPORTER_OTLP_HEADERS
}


def grace_period_s(cfg: ClusterConfig) -> int:
    """terminationGracePeriodSeconds for pods that drain: the drain, Serve's stop margin and
    process exit."""
    return int(cfg.replica.drain_timeout_s + SHUTDOWN_MARGIN_S + TERMINATION_MARGIN_S)


def ray_service(k: K8sConfig, cfg: ClusterConfig, serve: dict) -> dict:
    """The ``RayService``: ``serve`` (a whole Serve config) as its ``serveConfigV2``, a head
    group that takes no replica, one worker group of ``k.tp`` GPUs per pod."""
    labels = {"app.kubernetes.io/name": k.name, "app.kubernetes.io/component": "workers"}
    env = _env(cfg)
    container = {"image": k.image, "env": env}
    head = {
        # The KubeRay operator applies serveConfigV2 through the dashboard's REST API, so it
        # listens on the pod's interface; a token guards it (authOptions) and a NetworkPolicy
        # admits only this cluster's pods and the operator (network_policies).
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
            "securityContext": {"fsGroup": POD_FS_GROUP},
            "containers": [{
                "name": "ray-worker", **container, "env": env + _secret_env(k),
                "resources": _resources(k.worker_cpus, k.worker_memory, gpus=k.tp),
                "volumeMounts": [_models_mount(k), _tls_mount()]}],
            # The worker's certificate and the replica's (peer pulls), never the router's key.
            "volumes": [_models_volume(k), _secret_volume("internal-tls", k.internal_tls_secret,
                                                          WORKER_FILES + REPLICA_FILES)]}},
    }
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": k.name, "labels": {"app.kubernetes.io/name": k.name}},
        "spec": {
            "serveConfigV2": to_yaml(serve),
            "rayClusterConfig": {
                "rayVersion": k.ray_version,
                "authOptions": {"mode": "token"},  # the dashboard / Jobs API want a token
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
                "securityContext": {"fsGroup": POD_FS_GROUP},
                "containers": [{
                    "name": "router", "image": k.image,
                    "command": ["python", "-m", "kvfleet.router.main"], "args": args,
                    "env": _env(cfg) + [{"name": "OTEL_SERVICE_NAME", "value": "kvfleet-router"}]
                    + _secret_env(k),
                    "ports": [{"containerPort": GRPC_PORT, "name": "grpc"},
                              {"containerPort": HTTP_PORT, "name": "http"}],
                    "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
                    "resources": _resources(k.router_cpus, k.router_memory),
                    "volumeMounts": [_models_mount(k), _tls_mount(),
                                     {"name": "api-keys", "mountPath": API_KEYS_MOUNT,
                                      "readOnly": True}]}],
                "volumes": [_models_volume(k),
                            _secret_volume("internal-tls", k.internal_tls_secret, ROUTER_FILES),
                            _secret_volume("api-keys", k.api_keys_secret)]}},
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
                     # $(REDIS_PASSWORD): Kubernetes substitutes the Secret's value.
                     "args": ["--save", "", "--appendonly", "no",
                              "--requirepass", "$(REDIS_PASSWORD)"],
                     "env": [_secret_key_env("REDIS_PASSWORD", k.redis_secret, "password")],
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


def network_policies(k: K8sConfig) -> list[dict]:
    """[NetworkPolicy of the Ray pods, NetworkPolicy of Redis]: the Ray pods (head and
    workers: the replicas' gRPC ports, GCS, raylets, object transfer) admit only router pods
    and each other, plus the KubeRay operator on the dashboard port; Redis admits only router
    and Ray pods. Anything else in the cluster cannot reach a worker or the index."""
    def component(name: str) -> dict:
        return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": k.name,
                                                "app.kubernetes.io/component": name}}}

    def policy(name: str, target: str, ingress: list[dict]) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": k.service(name),
                             "labels": {"app.kubernetes.io/name": k.name}},
                "spec": {"podSelector": component(target)["podSelector"],
                         "policyTypes": ["Ingress"], "ingress": ingress}}

    operator = {"namespaceSelector": {},
                "podSelector": {"matchLabels": dict(k.operator_labels)}}
    return [
        policy("workers", "workers", [
            {"from": [component("router"), component("workers")]},
            {"from": [operator], "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}]),
        policy("redis", "redis", [
            {"from": [component("router"), component("workers")],
             "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]),
    ]


def _env(cfg: ClusterConfig) -> list[dict]:
    # OTLP headers are a secret: they come from a Secret (_secret_env), never inlined.
    return [{"name": n, "value": v} for n, v in sorted(cfg.replica.telemetry.to_env().items())
            if not n.endswith("_HEADERS")]


def _secret_key_env(name: str, secret: str, key: str, optional: bool = False) -> dict:
    ref = {"name": secret, "key": key, **({"optional": True} if optional else {})}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _secret_env(k: K8sConfig) -> list[dict]:
    """The Redis password and (when its Secret exists) the OTLP headers, by reference."""
    return [_secret_key_env(REDIS_PASSWORD_ENV, k.redis_secret, "password"),
            _secret_key_env(OTLP_HEADERS_ENV, k.otlp_headers_secret, "headers", optional=True)]


def _secret_volume(name: str, secret: str, items: tuple[str, ...] = ()) -> dict:
    """A Secret volume; ``items``: only these keys are mounted (each under its own name)."""
    volume: dict = {"secretName": secret, "defaultMode": SECRET_FILE_MODE}
    if items:
        volume["items"] = [{"key": key, "path": key} for key in items]
    return {"name": name, "secret": volume}


def _tls_mount() -> dict:
    return {"name": "internal-tls", "mountPath": INTERNAL_TLS_MOUNT, "readOnly": True}


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
