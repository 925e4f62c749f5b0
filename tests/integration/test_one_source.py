"""One source: the Serve config in the Kubernetes RayService and the one ``kvfleet up``
applies are made by the same function (``cluster_config.serve_application``) from the same
ClusterConfig, and the router Deployment runs the command ``kvfleet up`` starts. What the
tests' clusters run is what Kubernetes gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from kvfleet.deploy import k8s, serve_control
from kvfleet.deploy.cluster_config import router_args, serve_application
from kvfleet.router.flags import parse_args

COMMITTED = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
pytestmark = pytest.mark.slow


def _documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((COMMITTED / name).read_text()) if d]


def test_kvfleet_up_applies_serve_application_of_its_config(tiny_cluster):
    applied = tiny_cluster.app
    replica = applied["args"]["replica"]
    num_cpus = applied["deployments"][0]["ray_actor_options"]["num_cpus"]
    assert applied == serve_application(tiny_cluster.cfg, tiny_cluster.redis_url, num_cpus,
                                        replica["num_threads"])
    # ... and that is what Serve holds and runs.
    held = serve_control.app_configs()[tiny_cluster.app_name]
    assert held["args"] == applied["args"]
    assert held["deployments"] == applied["deployments"]


def test_the_rayservice_holds_serve_application_of_the_pods_config():
    k = k8s.K8sConfig()
    service = _documents("rayservice.yaml")[0]
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    cfg = k8s.cluster_config(k)
    expected = serve_control.deploy_config(
        [serve_application(cfg, cfg.replica.redis_url, 1.0, k.worker_cpus // k.tp)])
    assert embedded == expected
    # The same config stands alone for `serve run` / `serve deploy`, and Serve's own schema
    # (what both and KubeRay apply) accepts it.
    assert _documents("serve/serve-config.yaml") == [embedded]
    ServeDeploySchema.model_validate(embedded)
    # What the pods' replicas are told matches the cluster around them.
    replica = embedded["applications"][0]["args"]["replica"]
    assert replica["redis_url"] == f"redis://{k.service('redis')}:{k8s.REDIS_PORT}/0"
    assert replica["host"] == "0.0.0.0"
    assert replica["model_dir"] == f"{k.models_mount}/{k.model_name}"


def test_the_local_and_kubernetes_serve_apps_have_the_same_shape(tiny_cluster):
    """Both go through one function: the same fields, deployment, import path; they differ
    only in values (model, sizes, addresses)."""
    local = tiny_cluster.app
    kube = yaml.safe_load(_documents("rayservice.yaml")[0]["spec"]["serveConfigV2"])["applications"][0]

    def shape(d):
        return {k: shape(v) if isinstance(v, dict) else None for k, v in d.items()}

    assert shape(kube["args"]) == shape(local["args"])
    assert kube["import_path"] == local["import_path"]
    assert [d["name"] for d in kube["deployments"]] == [d["name"] for d in local["deployments"]]


def test_the_router_deployment_runs_the_kvfleet_up_router_command(tiny_cluster):
    # kvfleet up's router: python -m kvfleet.router.main + router_args(its config).
    cfg = tiny_cluster.cfg
    http_port = int(tiny_cluster.http_address.rsplit(":", 1)[1])
    assert tiny_cluster.router_proc.args[3:] == router_args(
        cfg.router_config(tiny_cluster.redis_url, http_port))
    # The router Deployment: the same module and router_args(the pods' config) ...
    k = k8s.K8sConfig()
    container = _documents("router.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "kvfleet.router.main"]
    pods = k8s.cluster_config(k)
    assert container["args"] == router_args(pods.router_config(pods.replica.redis_url))
    # ... which the router's own parser accepts, meaning what the manifest says.
    parsed = parse_args(container["args"])
    assert (parsed.host, parsed.port, parsed.http_port) == ("0.0.0.0", k8s.GRPC_PORT, k8s.HTTP_PORT)
    assert parsed.redis_url == pods.replica.redis_url
    assert parsed.shutdown_grace_s == k.drain_timeout_s
