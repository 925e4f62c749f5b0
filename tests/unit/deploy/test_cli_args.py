"""`kvfleet` command-line checks that need no cluster: empty prompts, log verbosity."""

from __future__ import annotations

import logging

import pytest

from kvfleet.deploy import cli
from kvfleet.deploy.cluster_config import router_args as router_command
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.router.flags import parse_args as router_args


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_a_usage_error_naming_the_flag(prompt, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--prompt", prompt])
    assert exit_.value.code == 2
    assert "--prompt must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "soon"])
def test_a_deadline_that_cannot_be_met_is_a_usage_error(timeout, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--prompt", "hi", "--timeout", timeout])
    assert exit_.value.code == 2 and "--timeout" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["generate", "--prompt", "hi",
                                          "--timeout", "2.5"]).timeout == 2.5


def test_vv_makes_the_router_log_every_routing_decision(tiny_llama_dir):
    one = cluster_config(cli.build_parser().parse_args(
        ["-v", "up", "--model", str(tiny_llama_dir)]))
    two = cluster_config(cli.build_parser().parse_args(
        ["-vv", "up", "--model", str(tiny_llama_dir)]))
    assert one.router.log_level == "INFO" and "--log-level" not in router_command(
        one.router_config("redis://127.0.0.1:1"))
    cfg = router_args(router_command(two.router_config("redis://127.0.0.1:1")))
    assert logging.getLevelName(cfg.log_level) == logging.DEBUG
    assert router_args(["--redis-url", "r", "--model-name", "m", "--model-dir", "/x"]).log_level == "INFO"


def test_up_adapters_are_parsed_expanded_and_checked_before_anything_starts(
        tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    args = cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--adapter", f"sql={tiny_adapters['qv']}",
         "--adapter-dir", str(tiny_adapters["qv"].parent), "--max-loras", "3",
         "--max-lora-rank", "8"])
    cfg = cluster_config(args).replica
    assert [n for n, _ in cfg.adapters] == ["sql", "all", "qv", "qv2", "rs"]
    assert cfg.max_loras == 3 and cfg.max_lora_rank == 8
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"], "use_dora": true}')
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--adapter", f"bad={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "adapter 'bad'" in err and "adapter_config.json: field 'use_dora'" in err
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--adapter", "no-equals-sign"]) == 2
    assert "--adapter takes NAME=DIR" in capsys.readouterr().err


def test_replica_host_reaches_the_replicas_config(tiny_llama_dir):
    from kvfleet.deploy.cluster_config import serve_application

    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--replica-host", "0.0.0.0"]))
    assert cfg.replica.host == "0.0.0.0"
    app = serve_application(cfg, "redis://127.0.0.1:1/0", num_cpus=0.5, threads=1)
    assert app["args"]["replica"]["host"] == "0.0.0.0"


def test_router_shutdown_grace_is_checked():
    base = ["--redis-url", "r", "--model-name", "m", "--model-dir", "/x"]
    assert router_args(base).shutdown_grace_s == 2.0
    assert router_args(base + ["--shutdown-grace-s", "45"]).shutdown_grace_s == 45.0
    with pytest.raises(SystemExit):
        router_args(base + ["--shutdown-grace-s", "-1"])


@pytest.mark.parametrize("bad", ["0", "-5", "inf", "nan", "fast"])
def test_a_bad_itl_target_is_a_usage_error_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["up", "--itl-target-ms", bad])
    assert exit_.value.code == 2 and "--itl-target-ms" in capsys.readouterr().err


def test_the_itl_target_reaches_the_replicas_scheduler_and_serve_config(tiny_llama_dir):
    from kvfleet.deploy.cluster_config import serve_application

    off = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    assert off.replica.scheduler.itl_target_ms is None  # default: the token budget alone
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--itl-target-ms", "80"]))
    assert cfg.replica.scheduler.itl_target_ms == 80.0
    app = serve_application(cfg, "redis://127.0.0.1:1/0", num_cpus=0.5, threads=1)
    assert app["args"]["replica"]["scheduler"]["itl_target_ms"] == 80.0


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_tenant_max_inflight_is_a_usage_error_naming_the_flag(value, tiny_llama_dir, capsys):
    base = ["--redis-url", "r", "--model-name", "m", "--model-dir", "/x"]
    assert router_args(base + ["--tenant-max-inflight", "8"]).tenant_max_inflight == 8
    for parse in (lambda: router_args(base + ["--tenant-max-inflight", value]),
                  lambda: cli.build_parser().parse_args(
                      ["up", "--model", str(tiny_llama_dir), "--tenant-max-inflight", value])):
        with pytest.raises(SystemExit) as exit_:
            parse()
        assert exit_.value.code == 2 and "--tenant-max-inflight" in capsys.readouterr().err
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--tenant-max-inflight", "5"]))
    assert cfg.router.tenant_max_inflight == 5


def test_upgrade_to_a_model_dir_without_config_json_fails_before_connecting(tmp_path, capsys,
                                                                             monkeypatch):
    """`kvfleet upgrade --model-dir` is checked before any cluster is looked up: exit 2 naming
    the flag, and nothing connects (find_app would raise if it were reached)."""
    from kvfleet.deploy import operate

    def unreachable(*_a, **_k):
        raise AssertionError("find_app reached")

    monkeypatch.setattr(operate, "find_app", unreachable)
    rc = cli.main(["upgrade", "--address", "127.0.0.1:1", "--namespace", "ns", "--revision", "rev-2",
                   "--model-dir", str(tmp_path / "nonexistent")])
    assert rc == 2
    assert f"--model-dir {tmp_path / 'nonexistent'}: no config.json" in capsys.readouterr().err
