"""Parameter counts from published config.json files (tests/fixtures/configs/): a
mixture-of-experts model's weights hold every expert once, a token runs its top-k.

Expected totals are the publishers' own figures: Mixtral-8x7B 46,702,792,704 parameters
(Mistral AI's release: "46.7B total, 12.9B active"); Qwen3-30B-A3B "30.5B total, 3.3B
activated" (its model card); gpt-oss-20b "20.91B total, 3.61B active" (OpenAI's model card,
active counting the unembedding but not the embedding table); Llama-3-8B 8.03B.
"""

from __future__ import annotations

import json

import pytest

from kvfleet.allocator.model_spec import ConfigError
from kvfleet.allocator.param_count import param_count
from kvfleet.deploy.budget import build_parser, compute_budget
from tests.unit.allocator.conftest import config_path, load


def test_mixtral_8x7b_exactly() -> None:
    c = param_count(load("mixtral-8x7b-v0.1"))
    assert c.total == 46_702_792_704
    assert round(c.active / 1e9, 1) == 12.9


def test_qwen3_30b_a3b() -> None:
    c = param_count(load("qwen3-30b-a3b"))
    assert round(c.total / 1e9, 1) == 30.5 and 3.3e9 <= c.active < 3.4e9
    # 48 layers x 128 experts x 3 x 2048 x 768 expert weights, each counted once
    assert c.total - c.active == 48 * (128 - 8) * 3 * 2048 * 768


def test_gpt_oss_20b() -> None:
    raw = load("gpt-oss-20b")
    c = param_count(raw)
    assert round(c.total / 1e9, 2) == 20.91
    embedding = raw["vocab_size"] * raw["hidden_size"]
    assert round((c.active - embedding) / 1e9, 2) == 3.61


def test_dense_models_run_every_parameter() -> None:
    c = param_count(load("llama-3-8b"))
    assert c.total == c.active and round(c.total / 1e9, 2) == 8.03


def test_top_k_above_the_experts_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="^num_experts_per_tok: 9 exceeds the 8 experts"):
        param_count({**load("mixtral-8x7b-v0.1"), "num_experts_per_tok": 9})


def test_budget_counts_the_weights_from_the_config(tmp_path) -> None:
    """``kvfleet budget --params config``: the weights' bytes are every expert's, once."""
    args = build_parser().parse_args([str(config_path("qwen3-30b-a3b")), "--memory", "80GB",
                                      "--params", "config", "--context", "4096", "--tp", "2"])
    r = compute_budget(args)
    total = param_count(load("qwen3-30b-a3b")).total
    assert r["params"] == total and r["weights_bytes"] == total * 2 // 2  # bf16 over two ranks
    assert r["active_params"] < total // 9
    assert r["bytes_per_token"] == 48 * 2 * 4 * 128 * 2  # layers x K,V x KV heads x head_dim x bf16
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**load("gpt-oss-20b"), "num_experts_per_tok": 33}))
    with pytest.raises(ConfigError, match="^num_experts_per_tok"):
        compute_budget(build_parser().parse_args([str(bad)]))
