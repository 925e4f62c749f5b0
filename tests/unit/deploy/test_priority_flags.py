"""Priority-class flags: they land in the replica's and router's configs; bad values exit 2
naming the flag."""

from __future__ import annotations

import pytest

from kvfleet.deploy import cli
from kvfleet.deploy.cluster_config import router_args
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.router.config import RouterConfig
from kvfleet.router.flags import parse_args


def test_priority_flags_land_in_the_configs(tiny_llama_dir) -> None:
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--batch-share", "0.5",
         "--priority-admit", "batch=0.6,default=0.9", "--class-headroom", "0"]))
    assert cfg.replica.scheduler.batch_share == 0.5
    assert cfg.replica.scheduler.class_headroom == 0
    assert cfg.router.priority_admit == {"interactive": 1.0, "default": 0.9, "batch": 0.6}
    plain = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    assert plain.replica.scheduler.batch_share == 1.0
    assert plain.replica.scheduler.class_headroom is None  # an eighth of max_num_seqs
    assert plain.router.priority_admit == RouterConfig().priority_admit


@pytest.mark.parametrize("argv, flag", [
    (["--batch-share", "0"], "--batch-share"), (["--batch-share", "x"], "--batch-share"),
    (["--class-headroom", "-1"], "--class-headroom"), (["--class-headroom", "x"], "--class-headroom"),
    (["--priority-admit", "urgent=1"], "--priority-admit"),
    (["--priority-admit", "batch=2"], "--priority-admit"),
    (["--tenant-share", "0"], "--tenant-share"), (["--tenant-share", "1.5"], "--tenant-share"),
    (["--tenant-share", "nan"], "--tenant-share"),
    (["--speculative-tokens", "17"], "--speculative-tokens"),
    (["--speculative-tokens", "0"], "--speculative-tokens"),
])
def test_bad_priority_flags_exit_2_naming_the_flag(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["up", *argv])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_the_router_command_carries_its_class_fractions(capsys) -> None:
    base = ["--redis-url", "redis://r", "--model-name", "m", "--model-dir", "/m"]
    cfg = parse_args([*base, "--priority-admit", "batch=0.5"])
    assert cfg.priority_admit["batch"] == 0.5
    assert parse_args(router_args(cfg)) == cfg
    with pytest.raises(SystemExit) as exit_:
        parse_args([*base, "--priority-admit", "batch=1.5"])
    assert exit_.value.code == 2 and "--priority-admit" in capsys.readouterr().err


def test_layer_yield_flag_is_auto_by_default_and_runs_at_any_tp_and_beside_a_tier(
        tiny_llama_dir) -> None:
    def config(*argv: str):
        return cluster_config(cli.build_parser().parse_args(
            ["up", "--model", str(tiny_llama_dir), *argv]))
    assert config().replica.scheduler.layer_yield == "auto"
    for mode in ("on", "off", "auto"):
        assert config("--layer-yield", mode).replica.scheduler.layer_yield == mode
    assert config("--layer-yield", "on", "--executor", "cost-model").replica.scheduler.layer_yield
    assert config("--layer-yield", "on", "--tp", "2").replica.scheduler.layer_yield == "on"
    beside_tier = config("--layer-yield", "on", "--kv-host-memory", "64MiB").replica
    assert beside_tier.scheduler.layer_yield == "on" and beside_tier.kv_host_memory_bytes
    assert config("--kv-host-memory", "64MiB").replica.kv_host_memory_bytes
