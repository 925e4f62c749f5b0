"""``--autoscale`` and its targets: the one flag table → ClusterConfig → the Serve config
(validated by Serve's own schema, policy import included); bad values exit 2 naming the flag."""

from __future__ import annotations

import pytest
from ray.serve.schema import ServeDeploySchema

from kvfleet.deploy import cli
from kvfleet.deploy.autoscale_serve import POLICY_PATH, PUSH_INTERVAL_ENV
from kvfleet.deploy.cluster_config import serve_application
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.deploy.launcher import LocalCluster
from kvfleet.deploy.serve_control import deploy_config


@pytest.mark.parametrize("flags, named", [
    (["--autoscale", "3..2", "--slo-ttft-ms", "500"], "--autoscale"),
    (["--autoscale", "0..2", "--slo-ttft-ms", "500"], "--autoscale"),
    (["--autoscale", "1..3", "--slo-ttft-ms", "0"], "--slo-ttft-ms"),
    (["--autoscale", "1..3", "--slo-itl-ms", "-4"], "--slo-itl-ms"),
    (["--autoscale", "1..3", "--target-kv-utilisation", "2"], "--target-kv-utilisation"),
    (["--autoscale", "1..3", "--slo-ttft-ms", "500", "--target-load", "0"], "--target-load"),
    (["--target-load", "0.8"], "needs --autoscale"),
    (["--autoscale", "1..3", "--slo-ttft-ms", "500", "--replicas", "2"], "--replicas"),
    (["--autoscale", "1..3"], "needs a target"),
    (["--slo-ttft-ms", "500"], "needs --autoscale")])
def test_bad_autoscale_config_exits_2_naming_the_flag(tiny_llama_dir, flags, named, capsys):
    assert cli.main(["up", "--model", str(tiny_llama_dir), *flags]) == 2
    assert named in capsys.readouterr().err


def test_a_malformed_range_is_a_usage_error(tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--model", str(tiny_llama_dir), "--autoscale", "3"])
    assert exit_.value.code == 2 and "--autoscale takes MIN..MAX" in capsys.readouterr().err


def test_autoscale_reaches_the_serve_config(tiny_llama_dir):
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--autoscale", "1..3",
         "--slo-ttft-ms", "800", "--slo-itl-ms", "150", "--downscale-delay", "20",
         "--target-load", "0.8"]))
    assert cfg.replicas == 1 and cfg.autoscale is not None
    assert cfg.autoscale.targets.slo_ttft_s == 0.8 and cfg.autoscale.downscale_delay_s == 20
    app = serve_application(cfg, "redis://127.0.0.1:1", num_cpus=0.5, threads=1)
    dep = app["deployments"][0]
    assert "num_replicas" not in dep and app["args"]["count"] == 1  # one replica per Serve replica
    auto = dep["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"]) == (1, 3, 1)
    assert auto["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": {
        "min_replicas": 1, "max_replicas": 3, "slo_ttft_s": 0.8, "slo_itl_s": 0.15,
        "target_load": 0.8, "load_band": 0.15, "headroom": 0.8, "margin": 0.4,
        "start_timeout_s": 120.0}}
    assert auto["metrics_interval_s"] == 2  # Serve 2.60's replicas push on this, not the env
    assert app["runtime_env"]["env_vars"][PUSH_INTERVAL_ENV] == "2"
    schema = ServeDeploySchema.model_validate(deploy_config([app]))  # imports the policy
    assert schema.applications[0].deployments[0].autoscaling_config["max_replicas"] == 3


def test_without_autoscale_the_count_is_fixed(tiny_llama_dir):
    cfg = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    assert cfg.autoscale is None and cfg.replicas == 2
    dep = serve_application(cfg, "redis://127.0.0.1:1", 0.5, 1)["deployments"][0]
    assert dep["num_replicas"] == 2 and "autoscaling_config" not in dep


def _sized(cfg, monkeypatch, free: dict) -> dict:
    """The launcher's Serve deployment of ``cfg`` on a Ray with ``free`` resources."""
    import ray

    monkeypatch.setattr(ray, "available_resources", lambda: dict(free))
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(free))
    cluster = LocalCluster(cfg)
    cluster.redis_url = "redis://127.0.0.1:1"
    return cluster._app_config()["deployments"][0]


def test_autoscaled_replicas_are_sized_so_that_max_of_them_place(tiny_llama_dir, monkeypatch):
    # Sized for twice MIN, the third of `--autoscale 1..3` on 2 CPUs never placed: it stayed
    # "starting" and the policy waited for it.
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--autoscale", "1..3",
         "--slo-ttft-ms", "800"]))
    dep = _sized(cfg, monkeypatch, {"CPU": 2.0})
    assert dep["ray_actor_options"]["num_cpus"] * 3 <= 2.0
    fixed = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    assert _sized(fixed, monkeypatch, {"CPU": 8.0})["ray_actor_options"]["num_cpus"] == 1.0


def test_a_max_that_cannot_be_placed_is_refused_naming_the_resources(tiny_llama_dir,
                                                                    monkeypatch):
    import dataclasses

    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--autoscale", "1..3",
         "--slo-ttft-ms", "800"]))
    with pytest.raises(ValueError, match=r"--autoscale MAX 3 need 3 Ray CPUs \(1 each\).* 2 free"):
        _sized(dataclasses.replace(cfg, replica_num_cpus=1.0), monkeypatch, {"CPU": 2.0})
    cuda = dataclasses.replace(cfg, replica=dataclasses.replace(cfg.replica, device="cuda",
                                                                executor="model"))
    with pytest.raises(ValueError, match=r"need 3 GPUs .* 2 free"):
        _sized(cuda, monkeypatch, {"CPU": 8.0, "GPU": 2.0})


def test_cost_model_replicas_get_a_process_each_unless_told(tiny_llama_dir):
    base = ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--replicas", "4"]
    cfg = cluster_config(cli.build_parser().parse_args(base))
    app = serve_application(cfg, "redis://127.0.0.1:1", 0.5, 1)
    assert app["deployments"][0]["num_replicas"] == 4 and app["args"]["count"] == 1
    shared = cluster_config(cli.build_parser().parse_args([*base, "--replicas-per-process", "2"]))
    app = serve_application(shared, "redis://127.0.0.1:1", 0.5, 1)
    assert app["deployments"][0]["num_replicas"] == 2 and app["args"]["count"] == 2
