"""``--kv-host-memory``: parsed like ``--kv-memory`` into the replica's config (bad values exit 2
naming the flag); ``kvfleet budget`` says how many blocks the host tier holds; ``kvfleet
status`` shows each node's tier."""

from __future__ import annotations

import json

import pytest

from kvfleet.deploy import cli
from kvfleet.deploy.budget import main as budget
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.deploy.status import format_status


def test_the_flag_lands_in_the_replica_config_and_bad_values_exit_2(tiny_llama_dir, capsys) -> None:
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--kv-host-memory", "64MiB"]))
    assert cfg.replica.kv_host_memory_bytes == 64 << 20
    default = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    assert default.replica.kv_host_memory_bytes is None
    assert default.replica.kv_peer_pull and not cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--no-kv-peer-pull"])).replica.kv_peer_pull
    assert default.replica.kv_hand_over and not cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--no-kv-hand-over"])).replica.kv_hand_over
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--kv-host-memory", "lots"]) == 2
    assert "--kv-host-memory" in capsys.readouterr().err
    assert default.replica.kv_prewarm_s == 0.0  # off
    assert cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--kv-prewarm-s", "2.5"])).replica.kv_prewarm_s == 2.5
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--model", str(tiny_llama_dir), "--kv-prewarm-s", "-1"])
    assert exit_.value.code == 2
    assert "--kv-prewarm-s" in capsys.readouterr().err


def test_budget_counts_the_blocks_of_every_rank_the_host_tier_holds(tiny_llama_dir, capsys) -> None:
    assert budget([str(tiny_llama_dir), "--kv-dtype", "fp32", "--block-size", "16",
                   "--kv-host-memory", "1MiB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    block = 16 * r["bytes_per_token"]  # all ranks' shards of one block
    assert r["kv_host_memory_bytes"] == 1 << 20
    assert r["host_tier_blocks"] == (1 << 20) // block and r["host_tier_tokens"] == 16 * (
        (1 << 20) // block)
    assert budget([str(tiny_llama_dir), "--kv-host-memory", "1MiB", "--tp", "1"]) == 0
    assert "host KV tier" in capsys.readouterr().out
    assert budget([str(tiny_llama_dir), "--kv-host-memory", "1M"]) == 2
    assert "--kv-host-memory" in capsys.readouterr().err


def test_status_shows_the_tier_of_each_node() -> None:
    tiers = [{"node": "abcdef0123", "namespace": "kvfleet:", "capacity_bytes": 1 << 30,
              "bytes_used": 3 << 20, "blocks": 4, "stored": 9, "evicted": 5, "restored": 2},
             {"node": "99999999ff", "namespace": "other:", "error": "timed out"}]
    text = format_status({"applications": [], "routers": [], "kv_tiers": tiers,
                          "redis": {"address": "r:6379", "up": True}})
    assert ("kv host tier on node abcdef01 (kvfleet:): 3 MiB of 1 GiB (4 block shards), 9 "
            "written back, 2 restored, 5 evicted") in text
    assert "kv host tier on node 99999999 (other:): timed out" in text


def test_kuberay_render_carries_the_host_tier(tmp_path) -> None:
    from kvfleet.deploy.k8s_cli import main as k8s

    assert k8s(["render", "--out", str(tmp_path), "--kv-host-memory-bytes", str(2 << 30),
                "--kv-prewarm-s", "3"]) == 0
    text = (tmp_path / "rayservice.yaml").read_text()
    assert f"kv_host_memory_bytes: {2 << 30}" in text and "kv_prewarm_s: 3.0" in text


def test_stopping_a_deployment_removes_its_node_tiers(tiny_llama_dir, monkeypatch) -> None:
    from kvfleet.deploy import launcher
    from kvfleet.deploy.cli import build_parser
    from kvfleet.deploy.cluster_flags import cluster_config
    from kvfleet.worker.kv_tier import node_tier

    cfg = cluster_config(build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--kv-host-memory", "64MiB"]))
    removed: list[str] = []
    monkeypatch.setattr(launcher.serve_control, "delete", lambda name, timeout_s: None)
    monkeypatch.setattr(node_tier, "remove_node_tiers", lambda ns: removed.append(ns) or 1)
    cluster = launcher.LocalCluster(cfg)
    cluster.app_name = "kvfleet-app"  # as if started: the application was applied
    cluster.stop()
    assert removed == [cfg.replica.namespace]  # after the replicas drained into them
    cluster.stop()  # idempotent: nothing left to remove
    assert removed == [cfg.replica.namespace]


def test_the_write_back_queue_and_run_are_flags_up_and_k8s_render_carry(tiny_llama_dir, tmp_path,
                                                                      capsys) -> None:
    from kvfleet.deploy.k8s_cli import main as k8s
    from kvfleet.worker.kv_tier.rank_tier import DEFAULT_MAX_PENDING_BYTES

    args = ["up", "--model", str(tiny_llama_dir), "--kv-host-memory", "1GiB",
            "--kv-write-back-queue", "256MiB", "--kv-write-back-run", "4MiB"]
    replica = cluster_config(cli.build_parser().parse_args(args)).replica
    assert (replica.kv_write_back_queue_bytes, replica.kv_write_back_run_bytes) == (256 << 20,
                                                                                    4 << 20)
    default = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    assert default.replica.kv_write_back_queue_bytes == DEFAULT_MAX_PENDING_BYTES
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["up", "--help"])
    assert "--kv-write-back-queue" in capsys.readouterr().out
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--kv-write-back-run", "0"]) == 2
    assert "kv_write_back_run_bytes" in capsys.readouterr().err
    assert k8s(["render", "--out", str(tmp_path), "--kv-host-memory-bytes", str(2 << 30),
                "--kv-write-back-queue-bytes", str(128 << 20)]) == 0
    assert f"kv_write_back_queue_bytes: {128 << 20}" in (tmp_path / "rayservice.yaml").read_text()
