"""The Kubernetes manifests (kvfleet.deploy.k8s): every object validates offline as the API
server and the KubeRay operator would judge it, the validator refuses what they refuse, the
committed files are what the renderer writes, and one replica's ranks fit one worker pod."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kvfleet.deploy import k8s
from kvfleet.deploy.k8s_cli import main as k8s_main
from tests.fixtures.manifests import InvalidManifest, validate

COMMITTED = Path(__file__).resolve().parents[3] / "deploy" / "k8s"


def _objects(k: k8s.K8sConfig) -> list[dict]:
    rendered = k8s.render(k)
    return [o for name, objs in rendered.items() if not name.startswith("serve/") for o in objs]


@pytest.mark.parametrize("k", [k8s.K8sConfig(), k8s.K8sConfig(tp=4, replicas=1, min_replicas=0,
                                                              max_replicas=8, router_replicas=3)],
                         ids=["default", "tp4"])
def test_every_rendered_object_validates(k):
    objects = _objects(k)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Deployment", "NetworkPolicy",
                     "NetworkPolicy", "RayService", "Service", "Service", "Service"]
    for obj in objects:
        validate(obj)


def test_committed_manifests_are_the_rendered_ones(tmp_path):
    assert k8s_main(["render", "--out", str(tmp_path)]) == 0
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.yaml"))
    assert written == sorted(str(p.relative_to(COMMITTED)) for p in COMMITTED.rglob("*.yaml"))
    for name in written:
        assert (COMMITTED / name).read_text() == (tmp_path / name).read_text(), (
            f"deploy/k8s/{name} is stale: run `kvfleet k8s render`")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_one_replicas_ranks_fit_one_worker_pod(tp):
    k = k8s.K8sConfig(tp=tp)
    service = k8s.render(k)["rayservice.yaml"][0]
    group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    deployment = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["deployments"][0]
    bundles = deployment.get("placement_group_bundles") or [deployment["ray_actor_options"]]
    gpus = sum(b.get("GPU", b.get("num_gpus", 0)) for b in bundles)
    cpus = sum(b.get("CPU", b.get("num_cpus", 0)) for b in bundles)
    assert gpus == tp == int(limits["nvidia.com/gpu"])
    assert cpus <= int(limits["cpu"])
    if tp > 1:
        assert deployment["placement_group_strategy"] == "STRICT_PACK"
    # The head holds no GPU and takes no replica.
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_pods_that_drain_outlive_the_drain():
    k = k8s.K8sConfig(drain_timeout_s=120)
    service, router = k8s.render(k)["rayservice.yaml"][0], k8s.render(k)["router.yaml"][0]
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["deployments"][0]
    worker_pod = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert serve["graceful_shutdown_timeout_s"] >= 120
    assert worker_pod["terminationGracePeriodSeconds"] > serve["graceful_shutdown_timeout_s"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    grace = float(args[args.index("--shutdown-grace-s") + 1])
    assert grace == 120 < router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def _service() -> dict:
    return copy.deepcopy(k8s.render(k8s.K8sConfig())["rayservice.yaml"][0])


def _group(obj: dict) -> dict:
    return obj["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def test_min_replicas_above_max_is_refused():
    obj = _service()
    _group(obj).update(minReplicas=5, maxReplicas=2, replicas=3)
    with pytest.raises(InvalidManifest, match="minReplicas 5 > maxReplicas 2"):
        validate(obj)


def test_replicas_outside_min_max_is_refused():
    obj = _service()
    _group(obj).update(minReplicas=1, maxReplicas=2, replicas=3)
    with pytest.raises(InvalidManifest, match="replicas 3 outside"):
        validate(obj)


def test_a_missing_head_group_is_refused():
    obj = _service()
    del obj["spec"]["rayClusterConfig"]["headGroupSpec"]
    with pytest.raises(InvalidManifest, match="headGroupSpec"):
        validate(obj)


def test_a_head_group_without_containers_is_refused():
    obj = _service()
    obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"] = []
    with pytest.raises(InvalidManifest, match="headGroupSpec.template.spec.containers"):
        validate(obj)


def test_duplicate_group_names_are_refused():
    obj = _service()
    groups = obj["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    groups.append(copy.deepcopy(groups[0]))
    with pytest.raises(InvalidManifest, match="groupName 'gpu-tp1' is not unique"):
        validate(obj)


def test_an_unknown_or_mistyped_field_is_refused():
    obj = _service()
    _group(obj)["maxReplica"] = 3  # a typo: the CRD lists maxReplicas
    with pytest.raises(InvalidManifest, match="maxReplica"):
        validate(obj)
    obj = _service()
    _group(obj)["minReplicas"] = "one"
    with pytest.raises(InvalidManifest, match="minReplicas"):
        validate(obj)


def test_a_serve_config_that_is_not_a_mapping_is_refused():
    obj = _service()
    obj["spec"]["serveConfigV2"] = "- not\n- a mapping\n"
    with pytest.raises(InvalidManifest, match="serveConfigV2"):
        validate(obj)


def test_core_objects_are_checked_strictly():
    deployment = copy.deepcopy(k8s.render(k8s.K8sConfig())["router.yaml"][0])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(InvalidManifest, match="replicas"):
        validate(deployment)
    deployment = copy.deepcopy(k8s.render(k8s.K8sConfig())["router.yaml"][0])
    deployment["spec"]["template"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(InvalidManifest):
        validate(deployment)


def test_bad_fleet_sizes_are_refused_before_rendering():
    with pytest.raises(ValueError, match=r"min_replicas \(5\)"):
        k8s.K8sConfig(min_replicas=5, max_replicas=4)
    with pytest.raises(ValueError, match=r"replicas \(9\)"):
        k8s.K8sConfig(replicas=9, max_replicas=4)
    assert k8s_main(["render", "--out", "/nonexistent-never", "--min-replicas", "5"]) == 2


def test_the_raycluster_kuberay_makes_of_the_rayservice_validates():
    # KubeRay creates a RayCluster whose spec is the RayService's rayClusterConfig.
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
               "metadata": {"name": "kvfleet-raycluster"},
               "spec": _service()["spec"]["rayClusterConfig"]}
    validate(cluster)
    cluster["spec"]["workerGroupSpecs"][0].update(minReplicas=3, maxReplicas=1)
    with pytest.raises(InvalidManifest, match="RayCluster/kvfleet-raycluster.*minReplicas 3 > maxReplicas 1"):
        validate(cluster)
    del cluster["spec"]["headGroupSpec"]
    with pytest.raises(InvalidManifest, match="headGroupSpec"):
        validate(cluster)


def test_the_itl_target_reaches_the_rendered_serve_config(tmp_path):
    serve = k8s.render(k8s.K8sConfig(itl_target_ms=120))["serve/serve-config.yaml"][0]
    assert serve["applications"][0]["args"]["replica"]["scheduler"]["itl_target_ms"] == 120
    assert k8s_main(["render", "--out", str(tmp_path), "--itl-target-ms", "0"]) == 2


def test_autoscale_renders_serves_policy_and_a_worker_group_over_min_max(tmp_path, capsys):
    from kvfleet.deploy.autoscale_serve import POLICY_PATH

    assert k8s_main(["render", "--out", str(tmp_path), "--autoscale", "2..6",
                     "--slo-ttft-ms", "1500", "--slo-itl-ms", "100", "--target-load", "0.8"]) == 0
    service = yaml.safe_load((tmp_path / "rayservice.yaml").read_text())
    validate(service)
    group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 6)
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    dep = serve["applications"][0]["deployments"][0]
    assert "num_replicas" not in dep
    auto = dep["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (2, 6)
    assert auto["policy"]["policy_function"] == POLICY_PATH
    assert auto["policy"]["policy_kwargs"]["slo_ttft_s"] == 1.5
    assert auto["policy"]["policy_kwargs"]["target_load"] == 0.8
    assert k8s_main(["render", "--out", str(tmp_path), "--autoscale", "1..3",
                     "--slo-ttft-ms", "900", "--max-replicas", "5"]) == 2
    assert "--max-replicas and --autoscale" in capsys.readouterr().err
    assert k8s_main(["render", "--out", str(tmp_path), "--autoscale", "4..3",
                     "--slo-ttft-ms", "900"]) == 2
    assert "--autoscale" in capsys.readouterr().err
