"""``--quantization`` / ``--quant-group-size``: into the replica config and the router's (whose
cache identity then matches the worker's), bad values refused naming the flag; ``kvfleet
budget --weights int8|int4`` counts what a quantized replica holds."""

from __future__ import annotations

import json

import pytest

from kvfleet.deploy import cli
from kvfleet.deploy.budget import main as budget
from kvfleet.deploy.cluster_config import router_args
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.router.main import parse_args
from kvfleet.router.served_model import ServedModel
from kvfleet.worker.replica.replica import ReplicaConfig, cache_identity
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.packed import QuantLayoutError


def _config(model_dir, *flags):
    return cluster_config(cli.build_parser().parse_args(["up", "--model", str(model_dir), *flags]))


def test_the_flags_reach_replica_and_router_with_one_identity(tiny_llama_dir) -> None:
    cfg = _config(tiny_llama_dir, "--quantization", "int4", "--quant-group-size", "64")
    assert (cfg.replica.quantization, cfg.replica.quant_group_size) == ("int4", 64)
    router = parse_args(router_args(cfg.router_config("redis://127.0.0.1:1")))
    assert (router.quantization, router.quant_group_size) == ("int4", 64)
    served = ServedModel.load("m", tiny_llama_dir, 16, "float32", "int4", 64)
    worker = cache_identity("m", tiny_llama_dir, "float32", 16, QuantConfig("int4", 64))
    plain = cache_identity("m", tiny_llama_dir, "float32", 16)
    assert served.identity == worker and worker.digest() != plain.digest()
    default = _config(tiny_llama_dir)
    assert default.replica.quantization == "none"
    assert "--quantization" not in router_args(default.router_config("redis://127.0.0.1:1"))
    assert ServedModel.load("m", tiny_llama_dir, 16).identity == plain


def test_bad_values_are_refused_naming_the_flag(tiny_llama_dir, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--model", str(tiny_llama_dir), "--quantization", "int3"])
    assert exit_.value.code == 2 and "--quantization" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quant_group_size"):
        ReplicaConfig("r", "m", str(tiny_llama_dir), quantization="int4", quant_group_size=3)
    for odd in ("7", "1", "0"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["up", "--model", str(tiny_llama_dir), "--quant-group-size", odd])
        assert exit_.value.code == 2
        assert "--quant-group-size must be an even integer >= 2" in capsys.readouterr().err


def test_a_group_size_that_cannot_tile_the_weights_is_refused_before_anything_starts(
        tiny_llama_dir) -> None:
    # hidden 64, MLP 128, 4 heads x 16: groups of 128 do not tile the hidden-size inputs, and
    # groups of 64 tile every whole weight but not o_proj's 32 inputs per rank at tp=2.
    with pytest.raises(QuantLayoutError, match=r"hidden_size: 64 inputs .* groups of 128 "
                                               r"\(--quant-group-size\)"):
        _config(tiny_llama_dir, "--quantization", "int8", "--quant-group-size", "128")
    with pytest.raises(QuantLayoutError, match=r"o_proj: 64 inputs over tp=2 .* groups of 64"):
        _config(tiny_llama_dir, "--quantization", "int4", "--quant-group-size", "64", "--tp", "2")
    assert _config(tiny_llama_dir, "--quantization", "int4", "--quant-group-size", "32",
                   "--tp", "2").replica.quant_group_size == 32
    # float weights never use the group size
    assert _config(tiny_llama_dir, "--quant-group-size", "128").replica.quantization == "none"


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_budget_weights_are_what_a_quantized_replica_holds(tiny_llama_dir, capsys, method) -> None:
    runner = ModelRunner(tiny_llama_dir, 4, 4, quantization=QuantConfig(method))
    params = sum(p.numel() for p in ModelRunner(tiny_llama_dir, 4, 4).model.parameters()) + sum(
        p.in_features * p.out_features for p in runner.model.projections())
    assert budget([str(tiny_llama_dir), "--weights", method, "--params", str(params),
                   "--memory", "1GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights"] == method
    # the replica adds only its fp32 norms (a few hundred weights) beyond the budget's count
    assert abs(report["weights_bytes"] - runner.weight_nbytes()) < 0.01 * runner.weight_nbytes()
    assert budget([str(tiny_llama_dir), "--weight-dtype", "fp32", "--params", str(params),
                   "--memory", "1GB"]) == 0
    assert f"({method})" not in capsys.readouterr().out


def test_budget_refuses_a_group_size_no_replica_takes(tiny_llama_dir, capsys) -> None:
    assert budget([str(tiny_llama_dir), "--weights", "int4", "--params", "1e6",
                   "--quant-group-size", "7"]) == 2
    assert "--quant-group-size must be an even integer >= 2" in capsys.readouterr().err
