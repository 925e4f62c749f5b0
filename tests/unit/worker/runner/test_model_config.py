"""config.json parsing: transformers 4.x and 5.x field names, per-family facts, clear refusals."""

from __future__ import annotations

import json

import pytest

from kvfleet.worker.runner.model_config import (
    DecoderStyle,
    UnsupportedModel,
    load_model_config,
    parse_model_config,
)

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}


def test_tiny_llama(tiny_llama_dir) -> None:
    c = load_model_config(tiny_llama_dir)
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (4, 2, 16, 3)
    assert c.rope.theta == 10000.0 and c.rope.scaling is None and c.local_rope is None
    assert c.rope.rotary_dim == c.head_dim and c.style == DecoderStyle()
    assert c.sliding_windows == (None,) * 3 and not c.qkv_bias and not c.tie_word_embeddings
    assert c.eos_token_ids == (2,) and c.max_position_embeddings == 256


def test_tiny_qwen2_has_qkv_bias_and_no_window(tiny_qwen2_dir) -> None:
    raw = json.loads((tiny_qwen2_dir / "config.json").read_text())
    assert raw["use_sliding_window"] is False
    c = load_model_config(tiny_qwen2_dir)
    assert c.qkv_bias and not c.o_bias and c.sliding_window is None and c.tie_word_embeddings


def test_tiny_mistral_window(tiny_mistral_dir) -> None:
    c = load_model_config(tiny_mistral_dir)
    assert c.sliding_windows == (8, 8, 8) and c.sliding_window == 8


def test_defaults_and_legacy_rope_fields() -> None:
    c = parse_model_config({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert c.num_kv_heads == 4 and c.head_dim == 16  # absent: MHA, hidden / heads
    assert c.rope.theta == 5e5 and c.rope.scaling.rope_type == "llama3"
    assert c.rope.scaling.original_max_position_embeddings == 8192


def test_explicit_head_dim_wins() -> None:
    assert parse_model_config({**BASE, "head_dim": 32}).head_dim == 32


def test_eos_ids_merge_generation_config_first() -> None:
    c = parse_model_config({**BASE, "eos_token_id": [7, 2]}, {"eos_token_id": [2, 9]})
    assert c.eos_token_ids == (2, 9, 7)
    assert parse_model_config({**BASE, "eos_token_id": None}).eos_token_ids == ()


def test_old_qwen2_sliding_layers_from_max_window_layers() -> None:
    raw = {**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
           "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 16,
           "max_window_layers": 2}
    assert parse_model_config(raw).sliding_windows == (None, None, 16, 16)


@pytest.mark.parametrize("change", [
    {"model_type": "qwen2", "num_key_value_heads": 2, "sliding_window": 16, "max_window_layers": 1},
    {"model_type": "qwen2", "num_key_value_heads": 2, "use_sliding_window": False,
     "sliding_window": 16, "layer_types": ["sliding_attention"] * 2},
    {"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 4},
    {"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 4,
     "layer_types": ["full_attention", "sliding_attention"]},
])
def test_the_engine_reads_the_allocators_shape(change) -> None:
    """One reader of config.json's shape: the engine's windows, heads and head width are the
    KV budget's (kvfleet.allocator.model_spec), so the two cannot disagree on a window."""
    from kvfleet.allocator.model_spec import spec_from_config

    raw = {**BASE, "architectures": None, **change}
    c, kv = parse_model_config(raw), spec_from_config(raw)
    assert c.sliding_windows == kv.windows
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        kv.num_hidden_layers, kv.num_attention_heads, kv.num_kv_heads, kv.layers[0].head_dim)


def test_qwen2_windows_follow_transformers_defaults() -> None:
    # Qwen2Config: use_sliding_window defaults to False (no window without it), and the flag
    # overrides a layer_types list that names sliding layers.
    raw = {**BASE, "architectures": None, "model_type": "qwen2", "num_key_value_heads": 2,
           "sliding_window": 16}
    assert parse_model_config(raw).sliding_windows == (None, None)
    listed = {**raw, "use_sliding_window": False, "layer_types": ["sliding_attention"] * 2}
    assert parse_model_config(listed).sliding_windows == (None, None)


def test_a_shape_field_missing_is_named() -> None:
    from kvfleet.allocator.model_spec import ConfigError

    with pytest.raises(ConfigError, match="num_key_value_heads"):  # mistral documents no default
        parse_model_config({**BASE, "architectures": None, "model_type": "mistral"})
    with pytest.raises(ConfigError, match="num_attention_heads"):
        parse_model_config({k: v for k, v in BASE.items() if k != "num_attention_heads"})


def test_architecture_from_model_type_when_absent() -> None:
    raw = {**BASE, "architectures": None, "model_type": "mistral", "num_key_value_heads": 2,
           "sliding_window": 4}
    assert parse_model_config(raw).architecture == "MistralForCausalLM"


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"architectures": None, "model_type": "gpt2"}, "^model_type: 'gpt2' is not supported"),
    ({"architectures": ["Gemma2ForCausalLM"]}, "^architectures: 'Gemma2ForCausalLM'"),
])
def test_unsupported_features_are_refused(change, match) -> None:
    with pytest.raises(UnsupportedModel, match=match):
        parse_model_config({**BASE, **change})


def test_an_architecture_no_family_builds_is_refused_at_build() -> None:
    """The registry is derived from the families' table; a config that slipped past it (built
    by hand) is still refused by name when the model is built."""
    import dataclasses

    import torch

    from kvfleet.worker.runner.models import build_model

    c = dataclasses.replace(parse_model_config(BASE), architecture="Gemma2ForCausalLM")
    with pytest.raises(UnsupportedModel, match="Gemma2ForCausalLM"):
        build_model(c, {}, torch.float32, "cpu")
