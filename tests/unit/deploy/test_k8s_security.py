"""Secure defaults of the Kubernetes render (item 13) and secrets kept out of command lines
and Serve application args (kvfleet.secrets)."""

from __future__ import annotations

import json

import yaml

from kvfleet.config_codec import from_dict
from kvfleet.deploy import k8s
from kvfleet.deploy.cluster_config import (
    ClusterConfig,
    router_args,
    router_env,
    serve_application,
)
from kvfleet.deploy.k8s_objects import API_KEYS_MOUNT, INTERNAL_TLS_MOUNT, SECRETS
from kvfleet.router.flags import parse_args
from kvfleet.secrets import REDIS_PASSWORD_ENV, split_redis_password
from kvfleet.telemetry import TelemetryConfig
from kvfleet.worker.replica.replica import ReplicaConfig
from kvfleet.worker.replica.serve_deployment import config_from_env
from tests.fixtures.manifests import validate

PASSWORD = "pw/with:odd@chars"
TOKEN = "Bearer%20collector-token"


def _render(k: k8s.K8sConfig | None = None) -> dict[str, list[dict]]:
    return k8s.render(k or k8s.K8sConfig())


def _pod(obj: dict) -> dict:
    if obj["kind"] == "RayService":
        return obj["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def _secret_refs(pod: dict) -> tuple[dict, dict]:
    """(env name → (secret, key), mount path → secret) of a pod's first container."""
    (container,) = pod["containers"]
    env = {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
           for e in container.get("env", []) if "valueFrom" in e}
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])
              if m["name"] in volumes}
    return env, mounts


def _tls_items(pod: dict) -> list[str]:
    """The keys of the internal TLS Secret a pod mounts (each under its own name)."""
    (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
    items = volume["secret"]["items"]
    assert all(i["key"] == i["path"] for i in items)
    return [i["key"] for i in items]


def test_the_router_requires_keys_and_tls_from_secrets_it_only_references():
    k = k8s.K8sConfig()
    router = _render(k)["router.yaml"][0]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = parse_args(args)
    assert parsed.api_keys_file == f"{API_KEYS_MOUNT}/keys.json"
    assert parsed.internal_tls_dir == INTERNAL_TLS_MOUNT
    env, mounts = _secret_refs(_pod(router))
    assert mounts == {API_KEYS_MOUNT: k.api_keys_secret, INTERNAL_TLS_MOUNT: k.internal_tls_secret}
    assert _tls_items(_pod(router)) == ["ca.pem", "router.pem", "router.key"]
    assert env[REDIS_PASSWORD_ENV] == (k.redis_secret, "password")
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == (k.otlp_headers_secret, "headers")
    assert _pod(router)["volumes"][1]["secret"]["defaultMode"] == 0o440


def test_workers_serve_mutual_tls_and_reach_redis_with_a_password_from_secrets():
    k = k8s.K8sConfig()
    service = _render(k)["rayservice.yaml"][0]
    env, mounts = _secret_refs(_pod(service))
    assert mounts == {INTERNAL_TLS_MOUNT: k.internal_tls_secret}
    # A worker serves its certificate and pulls from peers as a replica; it never holds the
    # router's client identity (which any worker could otherwise use against the others).
    assert _tls_items(_pod(service)) == ["ca.pem", "worker.pem", "worker.key", "replica.pem",
                                         "replica.key"]
    assert env[REDIS_PASSWORD_ENV] == (k.redis_secret, "password")
    replica = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["replica"]
    assert replica["host"] == "0.0.0.0" and replica["internal_tls_dir"] == INTERNAL_TLS_MOUNT
    assert split_redis_password(replica["redis_url"])[1] is None
    assert replica["telemetry"]["otlp_headers"] == []
    # The dashboard / Jobs API want a token.
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_redis_requires_the_secrets_password():
    k = k8s.K8sConfig()
    (container,) = _pod(_render(k)["redis.yaml"][0])["containers"]
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert container["env"] == [{"name": "REDIS_PASSWORD", "valueFrom": {
        "secretKeyRef": {"name": k.redis_secret, "key": "password"}}}]


def test_no_secret_value_or_secret_object_is_rendered():
    rendered = _render()
    for name, objects in rendered.items():
        assert "Secret" not in {o.get("kind") for o in objects}, name
    for field, keys in SECRETS.items():
        assert getattr(k8s.K8sConfig(), field) and keys  # every Secret is named and documented


def test_only_routers_reach_workers_and_redis():
    k = k8s.K8sConfig()
    workers, redis = _render(k)["network-policy.yaml"]
    for policy in (workers, redis):
        validate(policy)
        assert policy["spec"]["policyTypes"] == ["Ingress"]

    def sources(rule: dict) -> list[str]:
        return [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component",
                                                                    "operator")
                for p in rule["from"]]

    assert workers["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "workers"
    pods, operator = workers["spec"]["ingress"]
    assert sources(pods) == ["router", "workers"] and "ports" not in pods
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]  # the dashboard, for KubeRay
    assert operator["from"][0]["podSelector"]["matchLabels"] == dict(k.operator_labels)
    (rule,) = redis["spec"]["ingress"]
    assert sources(rule) == ["router", "workers"]
    assert rule["ports"] == [{"protocol": "TCP", "port": k8s.REDIS_PORT}]


def test_secrets_never_travel_in_serve_args_or_command_lines(monkeypatch):
    """kvfleet up with a password-protected Redis and OTLP headers: Serve's args and the
    router's command line hold neither; the environment carries both, and the processes
    merge them back."""
    url = "redis://:pw%2Fwith%3Aodd%40chars@10.0.0.9:6380/0"
    telemetry = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317",
                                          "OTEL_EXPORTER_OTLP_HEADERS": f"authorization={TOKEN}",
                                          "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x=1"})
    cfg = ClusterConfig(ReplicaConfig("m", "m", "/m", telemetry=telemetry))
    app = serve_application(cfg, url, num_cpus=0.5, threads=1)
    args_text = json.dumps(app["args"])
    assert PASSWORD not in args_text and "pw%2F" not in args_text
    assert "collector-token" not in args_text and "TRACES_HEADERS" not in args_text
    env = app["runtime_env"]["env_vars"]
    assert env[REDIS_PASSWORD_ENV] == PASSWORD
    assert env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "x=1"
    # A replica process merges them back from its environment.
    replica = config_from_env(from_dict(ReplicaConfig, app["args"]["replica"]), env)
    assert replica.redis_url == url
    assert replica.telemetry.otlp_headers == (("authorization", "Bearer collector-token"),)
    # The router: no password on its command line; its environment has it, and its parser
    # merges it.
    router = cfg.router_config(url)
    command = router_args(router)
    assert PASSWORD not in " ".join(command) and "pw%2F" not in " ".join(command)
    child = router_env(router, {"PATH": "/bin", "OTEL_SERVICE_NAME": "stale",
                                  REDIS_PASSWORD_ENV: "stale"})
    assert child[REDIS_PASSWORD_ENV] == PASSWORD and "OTEL_SERVICE_NAME" not in child
    monkeypatch.setenv(REDIS_PASSWORD_ENV, PASSWORD)
    assert parse_args(command).redis_url == url
