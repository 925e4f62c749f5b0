"""What ``--model-impl`` decides and refuses, before anything starts: one line naming why,
exit 2 from ``kvfleet up``, no cluster built; and the native path never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.allocator.kv_bytes import ShardingError
from kvfleet.deploy import cli
from kvfleet.worker.replica.replica import ReplicaConfig
from kvfleet.worker.runner.fallback.check import FallbackRequest, check_fallback
from kvfleet.worker.runner.fallback.tp import check_plan
from kvfleet.worker.runner.model_config import UnsupportedModel, parse_model_config
from kvfleet.worker.runner.model_impl import resolve_impl
from tests.fixtures.models import TINY_SHAPE


def _config(model_type: str, arch: str, **extra) -> dict:
    return {**TINY_SHAPE, "model_type": model_type, "architectures": [arch], **extra}


def _model_dir(root: Path, raw: dict) -> Path:
    """A directory ``resolve_model`` takes: config.json and an empty weights file (never read)."""
    d = root / raw["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    (d / "model.safetensors").write_bytes(b"")
    return d


OLMO2 = _config("olmo2", "Olmo2ForCausalLM")


def test_auto_is_native_when_registered_else_transformers() -> None:
    assert resolve_impl(_config("llama", "LlamaForCausalLM"), "auto") == "native"
    assert resolve_impl({"architectures": ["Qwen3ForCausalLM"]}, "auto") == "native"
    assert resolve_impl(OLMO2, "auto") == "transformers"
    assert resolve_impl(_config("llama", "LlamaForCausalLM"), "transformers") == "transformers"
    with pytest.raises(ValueError, match="^model_impl must be one of auto, native, transformers"):
        resolve_impl(OLMO2, "hf")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        ReplicaConfig(replica_id="r", model_name="m", model_dir="/x", model_impl="hf")


def test_the_fallback_config_reads_shape_eos_and_context() -> None:
    config = parse_model_config({**OLMO2, "eos_token_id": [2, 7]}, {"eos_token_id": 5}, "auto")
    assert (config.impl, config.architecture, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim) == ("transformers", "Olmo2ForCausalLM", 3, 4, 2, 16)
    assert config.eos_token_ids == (5, 2, 7) and config.max_position_embeddings == 256
    with pytest.raises(UnsupportedModel, match="^model_type: 'olmo2' is not supported"):
        parse_model_config(OLMO2)  # native only (the default)


# raw config, request → the start of the one-line refusal
CASES = {
    "layer-yield": (OLMO2, FallbackRequest(layer_yield=True), "--layer-yield: --model-impl "
                    "transformers runs the model's layers in one call"),
    "quantized": (OLMO2, FallbackRequest(quantization="int8"), "--quantization int8: "
                  "--model-impl transformers serves float weights only"),
    "no-attention-interface": (_config("stablelm", "StableLmForCausalLM"), FallbackRequest(),
                               "architectures: StableLmForCausalLM has no native family and its "
                               "transformers class does not take a registered attention function"),
    "unknown-class": (_config("mymodel", "MyModelForCausalLM"), FallbackRequest(),
                      "architectures: 'MyModelForCausalLM' is neither a native family nor a class"),
    "soft-capped": (_config("olmo2", "Olmo2ForCausalLM", attn_logit_softcapping=30.0),
                    FallbackRequest(), "attn_logit_softcapping: 30.0 is not computed"),
    "heads-do-not-split": (OLMO2, FallbackRequest(tp=3), "num_attention_heads: 4 heads do not "
                           "split over tp=3"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_naming_why(case, tmp_path) -> None:
    raw, request, expected = CASES[case]
    d = _model_dir(tmp_path, raw)
    with pytest.raises((UnsupportedModel, ShardingError)) as err:
        check_fallback(d, parse_model_config(raw, None, "transformers"), raw, request)
    assert str(err.value).startswith(expected), err.value


def test_tp_needs_a_plan_of_known_styles() -> None:
    config = parse_model_config(OLMO2, None, "transformers")
    check_plan(None, config, 1)  # tp=1 needs no plan
    with pytest.raises(UnsupportedModel, match="^base_model_tp_plan: Olmo2ForCausalLM declares none"):
        check_plan(None, config, 2)
    with pytest.raises(UnsupportedModel, match="'layers.\\*.mlp.experts': 'ep_router' is not supported"):
        check_plan({"layers.*.mlp.experts": "ep_router"}, config, 2)


@pytest.mark.parametrize("flags, expected", [
    (["--layer-yield", "on"], "error: --layer-yield: --model-impl transformers"),
    (["--quantization", "int4"], "error: --quantization int4: --model-impl transformers"),
    (["--tp", "3"], "error: num_attention_heads: 4 heads do not split over tp=3"),
    (["--model-impl", "native"], "error: model_type: 'olmo2' is not supported"),
])
def test_kvfleet_up_exits_2_with_one_line_before_the_cluster(flags, expected, tmp_path,
                                                             monkeypatch, capsys) -> None:
    import kvfleet.deploy.launcher as launcher

    def never(*_args, **_kwargs):
        raise AssertionError("the cluster was built for a model the fallback refuses")

    monkeypatch.setattr(launcher, "LocalCluster", never)
    d = _model_dir(tmp_path, OLMO2)
    assert cli.main(["up", "--model", str(d), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(expected), err


def test_cluster_config_takes_the_flag(tmp_path) -> None:
    from kvfleet.deploy.cluster_flags import cluster_config

    d = _model_dir(tmp_path, OLMO2)
    cfg = cluster_config(cli.build_parser().parse_args(["up", "--model", str(d)]))
    assert cfg.replica.model_impl == "auto"
    with pytest.raises(UnsupportedModel, match="^--layer-yield"):
        cluster_config(cli.build_parser().parse_args(["up", "--model", str(d), "--layer-yield", "on"]))


NATIVE_RUN = """
import sys
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner.model_runner import ModelRunner
runner = ModelRunner(sys.argv[1], num_blocks=8, block_size=4, model_impl="auto")
runner.execute(StepPlan((SeqChunk("a", (1, 2, 3), 0, (0,)),)))
print(runner.config.impl, "transformers" in sys.modules)
"""


def test_the_native_path_never_imports_transformers(tiny_llama_dir) -> None:
    out = subprocess.run([sys.executable, "-c", NATIVE_RUN, str(tiny_llama_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["native", "False"]


def test_transformers_is_an_optional_extra_only() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[4] / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("transformers")]
    assert [d for d in project["optional-dependencies"]["transformers"]
            if d.startswith("transformers")]
