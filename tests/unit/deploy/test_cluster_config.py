"""One declaration per setting: ClusterConfig composes the replica's and the router's configs
(declaring none of their fields again), the ``kvfleet up`` flags come from one table whose
defaults are the declarations', the router's command line parses back to its config, and
the deploy modules import one another without a cycle."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from kvfleet.deploy import cli
from kvfleet.deploy.cluster_config import SHARED, ClusterConfig, router_args, router_from_flags
from kvfleet.deploy.cluster_flags import FLAGS, OWNERS, cluster_config, declared_default
from kvfleet.flag_table import GROUPS, by_name, field_value
from kvfleet.router.config import RouterConfig
from kvfleet.router.core import PromptLimits
from kvfleet.router.flags import ROUTER_FLAGS, parse_args
from kvfleet.stream_limits import StreamLimits
from kvfleet.telemetry import TelemetryConfig
from kvfleet.worker.replica.replica import ReplicaConfig

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _replica(**settings) -> ReplicaConfig:
    return ReplicaConfig("m", "m", "/models/m", **settings)


def test_cluster_config_declares_no_field_of_the_configs_it_composes() -> None:
    mine = _names(ClusterConfig)
    assert not mine & (_names(ReplicaConfig) | _names(RouterConfig))
    assert {"replica", "router", "autoscale"} <= mine and len(mine) == 13
    # What the router shares with the replicas is named once, as existing fields of both.
    assert {r for r, _ in SHARED} <= _names(RouterConfig)
    assert {w for _, w in SHARED} <= _names(ReplicaConfig)


def test_every_flag_sets_a_declared_field_and_defaults_to_its_declaration(tiny_llama_dir) -> None:
    cfg = cluster_config(cli.build_parser().parse_args(["up", "--model", str(tiny_llama_dir)]))
    for flag in FLAGS:
        if flag.field is None:
            continue
        owner, _, name = flag.field.rpartition(".")
        assert OWNERS[owner] is dict or name in _names(OWNERS[owner]), flag.flag
        value = field_value(cfg, flag.field)
        if flag.flag == "--http-port":  # the one flag whose default is the CLI's: HTTP on
            assert value == 8000 and declared_default(flag.field) is None
        else:
            assert value == declared_default(flag.field), flag.flag


def test_flags_land_in_the_config_that_reads_them(tiny_llama_dir) -> None:
    cfg = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--replicas", "3", "--port", "0",
         "--policy", "round_robin", "--max-num-seqs", "4", "--drain-timeout", "7",
         "--kv-memory", "1MiB", "--http-port", "-1", "--metrics-port", "0"]))
    assert cfg.replicas == 3 and cfg.metrics_port == 0
    assert (cfg.router.port, cfg.router.policy, cfg.router.http_port) == (0, "round_robin", None)
    assert cfg.replica.scheduler.max_num_seqs == 4 and cfg.replica.drain_timeout_s == 7.0
    assert cfg.replica.kv_memory_bytes == 1 << 20
    assert cfg.replica.replica_id == cfg.replica.model_name == tiny_llama_dir.name
    knobs = cluster_config(cli.build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--host-hit-weight", "0.75", "--no-index-mirror"]))
    assert knobs.router.policy_options == {"host_hit_weight": 0.75}
    assert not knobs.router.index_mirror and cfg.router.policy_options == {}
    router = knobs.router_config("redis://r:6379/0")
    assert parse_args(router_args(router)) == router  # carried to the router process


def test_the_router_takes_what_it_shares_from_the_replica() -> None:
    telemetry = TelemetryConfig(otlp_endpoint="http://collector:4317")
    cfg = ClusterConfig(_replica(block_size=32, dtype="bfloat16", namespace="ns:",
                                 internal_tls_dir="/tls", telemetry=telemetry),
                        RouterConfig(port=0, policy="least_loaded"), metrics_port=9100)
    router = cfg.router_config("redis://r:6379/0", http_port=8080)
    assert (router.model_name, router.model_dir, router.block_size, router.kv_dtype) == (
        "m", "/models/m", 32, "bfloat16")
    assert (router.namespace, router.redis_url, router.internal_tls_dir) == (
        "ns:", "redis://r:6379/0", "/tls")
    assert router.telemetry == dataclasses.replace(telemetry, metrics_port=9100)
    assert (router.port, router.policy, router.http_port) == (0, "least_loaded", 8080)


@pytest.mark.parametrize("router, field", [
    (RouterConfig(block_size=32), "router.block_size"),
    (RouterConfig(model_name="other"), "router.model_name"),
    (RouterConfig(telemetry=TelemetryConfig(otlp_endpoint="http://x:4317")), "router.telemetry"),
])
def test_a_shared_setting_set_on_the_router_unlike_the_replica_is_refused(router, field) -> None:
    with pytest.raises(ValueError, match=rf"{field} .* differs from replica\."):
        ClusterConfig(_replica(), router)
    ClusterConfig(_replica(), dataclasses.replace(router, **{  # the same value is no conflict
        field.split(".")[1]: getattr(_replica(), dict(SHARED)[field.split(".")[1]])}))


def test_per_replica_metrics_port_and_replica_count_are_refused() -> None:
    with pytest.raises(ValueError, match="ClusterConfig.metrics_port"):
        ClusterConfig(_replica(telemetry=TelemetryConfig(metrics_port=9000)))
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        ClusterConfig(_replica(), replicas=0)


def test_the_router_command_line_parses_back_to_its_config(monkeypatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    cfg = ClusterConfig(_replica(namespace="ns:", internal_tls_dir="/tls"), RouterConfig(
        host="0.0.0.0", port=7000, http_max_connections=9, policy="prefix_aware",
        api_keys_file="/keys.json", index_mirror=False, log_level="DEBUG",
        policy_options={"load_penalty_blocks": 2.5, "popularity_window": 64,
                        "host_hit_weight": 0.75},
        retry_pushback_ms=77, shutdown_grace_s=30.0, tls_cert="/c.pem", tls_key="/k.pem",
        stream_limits=StreamLimits(max_unread=5, stall_s=1.5), tenant_max_inflight=12,
        call_idle_s=45.0, prompt_limits=PromptLimits(max_prompt_bytes=4096, max_messages=8,
                                                     max_prompts=2, tokenizer_threads=3)),
        metrics_port=9100)
    router = cfg.router_config("redis://r:6379/0", http_port=8000)
    assert parse_args(router_args(router)) == router
    plain = ClusterConfig(_replica()).router_config("redis://r")
    assert parse_args(router_args(plain)) == plain


def test_benchmark_router_flags_become_router_settings() -> None:
    router = router_from_flags(["--no-index-mirror", "--max-imbalance", "3"])
    assert not router.index_mirror and router.policy_options == {"max_imbalance": 3.0}
    assert router.model_name == "" and router.telemetry == TelemetryConfig()


def test_tp_needs_the_model_executor_is_checked_once_by_the_replica(tiny_llama_dir, capsys) -> None:
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--tp", "2",
                     "--executor", "cost-model"]) == 2
    assert "tensor_parallel_size > 1 needs the model executor" in capsys.readouterr().err


def test_up_help_lists_the_flags_by_section(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    out = capsys.readouterr().out
    sections = [line.rstrip(":") for line in out.splitlines() if line.rstrip(":") in GROUPS]
    assert sections == list(GROUPS)  # every section has a flag, in this order
    assert {f.group for f in FLAGS} == set(GROUPS)


def test_num_blocks_and_kv_memory_are_refused_together_by_the_replica(tiny_llama_dir,
                                                                      capsys) -> None:
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--num-blocks", "64",
                     "--kv-memory", "1MiB"]) == 2
    assert "(--num-blocks) and kv_memory_bytes (--kv-memory) exclude" in capsys.readouterr().err


def _flag_literals(path: Path) -> list[str]:
    """The flag strings of every ``Flag("--…", …)`` row and ``add_argument("--…")`` call."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "Flag", "add_argument")):
            found.append(node.args[0].value)
    return found


def test_each_flag_is_declared_once_and_the_router_parser_is_the_table() -> None:
    router = DEPLOY.parent / "router"
    rows = _flag_literals(router / "flags.py") + _flag_literals(DEPLOY / "cluster_flags.py")
    assert len(rows) == len(set(rows)) and "--block-size" in rows
    assert _flag_literals(router / "main.py") == []
    # up's rows for the router's settings are the router's rows, set on another field.
    up, own = by_name(FLAGS), by_name(ROUTER_FLAGS)
    for name in set(up) & set(own):
        assert (up[name].type, up[name].choices, up[name].action) == (
            own[name].type, own[name].choices, own[name].action), name


def _deploy_imports() -> dict[str, set[str]]:
    graph = {}
    for path in DEPLOY.glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "kvfleet.deploy":
                    names |= {a.name for a in node.names}
                elif node.module.startswith("kvfleet.deploy."):
                    names.add(node.module.split(".")[2])
        graph[path.stem] = names & {p.stem for p in DEPLOY.glob("*.py")}
    return graph


def test_deploy_modules_import_each_other_without_a_cycle() -> None:
    graph, done, path = _deploy_imports(), set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert "launcher" not in graph["operate"] and "k8s" not in graph["k8s_objects"]
