"""``kvfleet status`` rows from Serve's and the registry's views, and the config codec that
carries replica configs through Serve's application config."""

from __future__ import annotations

import json

import pytest

from kvfleet.config_codec import from_dict, to_dict
from kvfleet.deploy.registry_view import RegistryEntry
from kvfleet.deploy.serve_app import Placement, app_config
from kvfleet.deploy.status import format_status, replica_rows
from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.telemetry import TelemetryConfig
from kvfleet.worker.executor.cost_model import MEASURED
from kvfleet.worker.replica.replica import ReplicaConfig
from kvfleet.worker.replica.serve_deployment import replica_configs


def _entry(rid: str, host: str, state: str = "serving") -> RegistryEntry:
    info = ReplicaInfo(rid, f"127.0.0.1:{len(rid)}", "m", 3, 16, state=state, serve_replica=host,
                       prefix_hit_rate=0.5,
                       ranks=({"rank": 0, "node_id": "abcdef123456", "device": "cpu", "pid": 7},))
    return RegistryEntry(info, ReplicaLoad(2, 1, 10, 64, 0.0, queue_delay_s=1.25,
                                           prefill_token_s=0.001), 0.4)


def test_rows_join_serve_and_registry_states() -> None:
    serve = [{"replica_id": "a", "state": "RUNNING", "pid": 1},
             {"replica_id": "b", "state": "STARTING", "pid": 2},
             {"replica_id": "c", "state": "RUNNING", "pid": 3},   # deregistered: failed
             {"replica_id": "d", "state": "STOPPING", "pid": 4},  # drained and gone
             {"replica_id": "e", "state": "STOPPING", "pid": 5}]
    entries = [_entry("m-a", "a"), _entry("m-e", "e", "draining"), _entry("m-x", "x")]
    rows = {r["replica_id"]: r for r in replica_rows(serve, entries, tp=2)}
    assert sorted(rows) == ["(serve b)", "(serve c)", "m-a", "m-e", "m-x"]
    assert rows["m-a"]["state"] == "serving" and rows["m-a"]["kv_blocks_used"] == 54
    assert rows["m-a"]["ranks"] == [{"rank": 0, "node": "abcdef123456", "device": "cpu", "pid": 7,
                                     "kv_bytes": 0, "num_blocks": 0, "weight_bytes": 0}]
    assert rows["m-e"]["state"] == "draining"
    assert rows["m-x"]["state"] == "failed" and rows["m-x"]["serve_state"] == "GONE"
    assert rows["(serve b)"]["state"] == "starting" and rows["(serve b)"]["tp"] == 2
    assert rows["(serve c)"]["state"] == "failed"
    status = {"applications": [{"app": "ns.m", "model": "m", "revision": "", "serve_status":
                                "RUNNING", "target_replicas": 2, "replicas": list(rows.values())}],
              "routers": [], "redis": {"address": "127.0.0.1:6379", "up": False}}
    text = format_status(status)
    assert "m-a" in text and "draining" in text and "UNREACHABLE" in text and "50%" in text
    assert "QDELAY" in text and "1.25s" in text  # each replica's predicted queue delay
    assert rows["m-a"]["queue_delay_s"] == 1.25 and rows["(serve b)"]["queue_delay_s"] is None


def test_replica_config_survives_the_application_config_as_json() -> None:
    cfg = ReplicaConfig("m", "m", "/models/m", cost_model=MEASURED, executor="cost-model",
                        telemetry=TelemetryConfig(resource_attributes=(("k", "v"),)))
    app = app_config(cfg, 5, Placement(0.5), per_host=2, revision="r1", env={"A": "1"})
    again = json.loads(json.dumps(app))
    assert from_dict(ReplicaConfig, again["args"]["replica"]) == cfg
    (dep,) = again["deployments"]
    assert dep["num_replicas"] == 3 and again["args"]["count"] == 2
    assert dep["graceful_shutdown_timeout_s"] > cfg.drain_timeout_s
    assert "placement_group_bundles" not in dep
    with pytest.raises(TypeError, match="bogus"):
        from_dict(ReplicaConfig, {**to_dict(cfg), "bogus": 1})


def test_tensor_parallel_placement_has_one_bundle_per_rank() -> None:
    p = Placement(0.5, tensor_parallel_size=3, rank_num_cpus=0.05)
    assert p.bundles() == [{"CPU": pytest.approx(0.4)}, {"CPU": 0.05}, {"CPU": 0.05}]
    assert Placement(0, 2, cuda=True).bundles() == [{"CPU": 0.01, "GPU": 1.0}, {"GPU": 1.0}]
    cfg = ReplicaConfig("m", "m", "/m", tensor_parallel_size=3)
    dep = app_config(cfg, 2, p)["deployments"][0]
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    assert len(dep["placement_group_bundles"]) == 3


def test_hosted_replica_ids_and_free_metrics_ports() -> None:
    base = ReplicaConfig("m", "m", "/m", telemetry=TelemetryConfig(metrics_port=9100))
    one, = replica_configs(base, "abc", 1)
    assert one.replica_id == "m-abc" and one.serve_replica == "abc"
    assert one.telemetry.metrics_port == 0
    assert [c.replica_id for c in replica_configs(base, "abc", 2)] == ["m-abc-0", "m-abc-1"]
    with pytest.raises(ValueError):
        replica_configs(base, "abc", 0)


def test_rows_carry_per_rank_kv_and_weight_bytes_and_the_adapters_held() -> None:
    """Item 19: what Router.ClusterStatus has per rank, and each replica's adapters with
    their revisions (resident = in a slot now)."""
    ranks = tuple({"rank": n, "node_id": "node", "device": f"cuda:{n}", "pid": 10 + n,
                   "kv_bytes": 4 << 30, "num_blocks": 8192, "weight_bytes": 3 << 29}
                  for n in range(2))
    info = ReplicaInfo("m-a", "10.0.0.1:5", "m", 1, 16, tensor_parallel_size=2, ranks=ranks,
                       serve_replica="a", adapters=(("sql", "ab12" * 16), ("chat", "cd34" * 16)),
                       resident_adapters=("sql",))
    (row,) = replica_rows([{"replica_id": "a", "state": "RUNNING", "pid": 10}],
                          [RegistryEntry(info, ReplicaLoad(0, 0, 8192, 8192, 0.0), 0.1)], tp=2)
    assert [(k["rank"], k["kv_bytes"], k["num_blocks"], k["weight_bytes"]) for k in row["ranks"]] \
        == [(0, 4 << 30, 8192, 3 << 29), (1, 4 << 30, 8192, 3 << 29)]
    assert row["adapters"] == [{"name": "sql", "revision": "ab12" * 16, "resident": True},
                               {"name": "chat", "revision": "cd34" * 16, "resident": False}]
    text = format_status({"applications": [{"app": "ns.m", "model": "m", "revision": "",
                                            "serve_status": "RUNNING", "target_replicas": 1,
                                            "replicas": [row], "internal_tls": None}],
                          "routers": [], "redis": {"address": "r:6379", "up": True}})
    assert "rank 1: KV 4 GiB (8192 blocks), weights 1.5 GiB" in text
    assert "sql@ab12ab12ab12 (resident)" in text and "chat@cd34cd34cd34" in text
    # A replica registered by an older kvfleet (no byte figures) reads as zeros.
    old = ReplicaInfo("m-b", "x:1", "m", 1, 16, ranks=({"rank": 0},), serve_replica="b")
    (row,) = replica_rows([{"replica_id": "b", "state": "RUNNING"}],
                          [RegistryEntry(old, None, None)], tp=1)
    assert row["ranks"][0]["kv_bytes"] == 0 and row["adapters"] == []


def test_status_shows_days_to_expiry_of_the_internal_certificates(tmp_path) -> None:
    """Item 15: the replicas' internal TLS directory (from the application config) and the
    days each certificate in it has left."""
    from kvfleet.deploy.operate import internal_tls_status
    from kvfleet.tls_ca import generate_internal_tls

    assert internal_tls_status(None) is None
    generate_internal_tls(tmp_path / "tls", days=45)
    tls = internal_tls_status(str(tmp_path / "tls"))
    assert tls["dir"] == str(tmp_path / "tls")
    assert 44.9 <= tls["certificates"]["worker.pem"]["days_left"] <= 45
    app = {"app": "ns.m", "model": "m", "revision": "", "serve_status": "RUNNING",
           "target_replicas": 0, "replicas": [], "internal_tls": tls}
    text = format_status({"applications": [app], "routers": [],
                          "redis": {"address": "r:6379", "up": True}})
    assert f"worker.pem expires in {tls['certificates']['worker.pem']['days_left']:g} days" in text
    missing = internal_tls_status(str(tmp_path / "elsewhere"))
    assert "error" in missing["certificates"]["ca.pem"]
    app["internal_tls"] = missing
    assert "unreadable here" in format_status({"applications": [app], "routers": [],
                                               "redis": {"address": "r:6379", "up": True}})



def test_status_shows_the_autoscale_target_current_and_last_decision() -> None:
    app = {"app": "ns.m", "model": "m", "revision": "", "serve_status": "RUNNING",
           "target_replicas": 3, "replicas": [], "internal_tls": None,
           "autoscale": {"min": 1, "max": 4, "decision": None}}
    status = {"applications": [app], "routers": [], "redis": {"address": "r:6379", "up": True}}
    assert "autoscale 1..4: no decision yet" in format_status(status)
    app["autoscale"]["decision"] = {"target": 3, "current": 2, "reason": "ttft_p90",
                                    "detail": "queue_delay 0.41, ttft_p90 1.02", "age_s": 4.5}
    assert ("autoscale 1..4: target 3, current 2; last decision ttft_p90 (queue_delay 0.41, "
            "ttft_p90 1.02) 4.5 s ago") in format_status(status)
    del app["autoscale"]
    assert "autoscale" not in format_status(status)
    app["autoscale"] = {"min": 1, "max": 4, "decision": {
        "target": 2, "current": 2, "reason": "within_band", "detail": "ttft_p90 0.50",
        "age_s": 1.0, "last_change": {"from": 3, "to": 2, "reason": "sustained_margin"}}}
    assert "; last change 3 → 2 (sustained_margin)" in format_status(status)
