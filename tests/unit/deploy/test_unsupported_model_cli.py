"""``kvfleet up`` on a model the engine cannot run: one line naming the field, exit 2, before
anything starts (no Ray, no Serve replica retrying its constructor)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.deploy import cli
from tests.unit.allocator.conftest import load


def _model_dir(root: Path, name: str, config: dict) -> Path:
    """A directory ``resolve_model`` takes for a model (config.json + a safetensors file)."""
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    return d


# The command as a user runs it, reporting whether torch (the cluster flags' parser, the
# worker) was imported before it gave up: the refusal must come first.
CLI = """
import sys
from kvfleet.deploy.cli import main
code = main(sys.argv[1:])
print("torch" in sys.modules)
sys.exit(code)
"""


def test_an_unknown_model_type_exits_2_with_one_line_before_loading_torch(tmp_path) -> None:
    """``--model-impl native``: only registered families (``auto`` would try the fallback)."""
    d = _model_dir(tmp_path, "olmo", {**load("qwen3-0.6b"), "model_type": "olmo2",
                                      "architectures": ["Olmo2ForCausalLM"]})
    out = subprocess.run([sys.executable, "-c", CLI, "up", "--model", str(d),
                          "--model-impl", "native"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: model_type: 'olmo2' is not supported; families that work:")
    assert "qwen3 (Qwen3ForCausalLM)" in lines[0] and "gemma3_text" in lines[0]
    assert out.stdout.strip() == "False"  # torch never loaded


CASES = {
    "missing-field": ({k: v for k, v in load("gemma-3-1b-it").items() if k != "hidden_size"},
                      "error: hidden_size: missing from config.json"),
    "vision-tower": ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                      "text_config": load("gemma-3-1b-it"), "vision_config": {}},
                     "error: vision_config: multimodal checkpoints"),
    "soft-capped-attention": ({**load("gemma-3-1b-it"), "attn_logit_softcapping": 50.0},
                              "error: attn_logit_softcapping: 50.0 is not supported"),
    "mla": ({**load("llama-3-8b"), "kv_lora_rank": 512, "qk_rope_head_dim": 64},
            "error: kv_lora_rank: MLA attention is not supported"),
    # unregistered: --model-impl auto tries the fallback, which caches K/V only
    "mamba-hybrid": (load("jamba-1.5-mini"), "error: attn_layer_period: hybrid (non-attention) "
                                             "layers are not supported"),
    # mixture-of-experts configs: a top-k above the expert count, a missing expert field
    "moe-top-k-above-experts": ({**load("qwen3-30b-a3b"), "num_experts_per_tok": 129},
                                "error: num_experts_per_tok: 129 exceeds the 128 experts"),
    "moe-missing-expert-width": ({k: v for k, v in load("qwen3-30b-a3b").items()
                                  if k != "moe_intermediate_size"},
                                 "error: moe_intermediate_size: missing from config.json"),
    "moe-missing-expert-count": ({k: v for k, v in load("mixtral-8x7b-v0.1").items()
                                  if k != "num_local_experts"},
                                 "error: num_local_experts: missing from config.json"),
    "moe-missing-top-k": ({k: v for k, v in load("gpt-oss-20b").items()
                           if k != "num_experts_per_tok"},
                          "error: num_experts_per_tok: missing from config.json"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_the_cluster_is_built(case, tmp_path, monkeypatch, capsys) -> None:
    import kvfleet.deploy.launcher as launcher

    def never(*_args, **_kwargs):
        raise AssertionError("the cluster was built for a model the engine refuses")

    monkeypatch.setattr(launcher, "LocalCluster", never)
    config, expected = CASES[case]
    d = _model_dir(tmp_path, case, config)
    assert cli.main(["up", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(expected), err


def test_cluster_config_refuses_it_too(tmp_path) -> None:
    """The same check where a cluster's config is built (callers other than the command line)."""
    from kvfleet.deploy.cluster_flags import cluster_config
    from kvfleet.worker.runner.model_config import UnsupportedModel

    d = _model_dir(tmp_path, "capped", CASES["soft-capped-attention"][0])
    with pytest.raises(UnsupportedModel, match="^attn_logit_softcapping"):
        cluster_config(cli.build_parser().parse_args(["up", "--model", str(d)]))
