"""model_spec: per-layer KV spec derived from real config.json files and architecture rules."""

import pytest

from kvfleet.allocator.model_spec import ConfigError, spec_from_config

from .conftest import load, spec


def test_llama_2_7b_is_mha():
    s = spec("llama-2-7b")
    assert (len(s.layers), s.num_kv_heads, s.layers[0].head_dim) == (32, 32, 128)
    assert s.windows == (None,) * 32
    assert s.max_position_embeddings == 4096


def test_llama_default_kv_heads_is_mha_when_the_field_is_missing():
    cfg = load("llama-2-7b")
    del cfg["num_key_value_heads"]
    assert spec_from_config(cfg).num_kv_heads == 32


def test_llama_3_8b_is_gqa():
    s = spec("llama-3-8b")
    assert (s.num_attention_heads, s.num_kv_heads, s.layers[0].head_dim) == (32, 8, 128)


def test_gemma_2_27b_explicit_head_dim_and_alternating_windows():
    s = spec("gemma-2-27b")
    assert s.layers[0].head_dim == 128  # not hidden_size / heads = 4608 / 32 = 144
    assert 4608 // 32 == 144
    assert s.num_kv_heads == 16
    assert [layer.window for layer in s.layers[:4]] == [4096, None, 4096, None]
    assert sum(w == 4096 for w in s.windows) == 23
    assert sum(w is None for w in s.windows) == 23


def test_layer_types_when_present_override_the_rule():
    cfg = load("gemma-2-27b")
    cfg["layer_types"] = ["full_attention"] * 45 + ["sliding_attention"]
    s = spec_from_config(cfg)
    assert s.windows == (None,) * 45 + (4096,)


def test_layer_types_must_match_layers_and_be_known():
    cfg = load("gemma-2-27b")
    cfg["layer_types"] = ["full_attention"] * 3
    with pytest.raises(ConfigError, match="^layer_types: "):
        spec_from_config(cfg)
    cfg["layer_types"] = ["chunked_attention"] * 46
    with pytest.raises(ConfigError, match="^layer_types: unsupported"):
        spec_from_config(cfg)


def test_qwen2_use_sliding_window_false_disables_the_window():
    s = spec("qwen2.5-32b")
    assert load("qwen2.5-32b")["sliding_window"] == 131072
    assert s.windows == (None,) * 64
    assert (s.num_kv_heads, s.layers[0].head_dim) == (8, 128)  # 5120 / 40


def test_qwen2_enabled_window_applies_from_max_window_layers_on():
    cfg = load("qwen2.5-32b")
    cfg.update(use_sliding_window=True, sliding_window=4096, max_window_layers=60)
    s = spec_from_config(cfg)
    assert s.windows == (None,) * 60 + (4096,) * 4


def test_mistral_window_applies_to_every_layer_and_null_disables_it():
    assert spec("mistral-7b-v0.1").windows == (4096,) * 32
    cfg = load("mistral-7b-v0.1")
    cfg["sliding_window"] = None
    assert spec_from_config(cfg).windows == (None,) * 32


def test_deepseek_v3_is_mla_whatever_num_key_value_heads_says():
    s = spec("deepseek-v3")
    assert load("deepseek-v3")["num_key_value_heads"] == 128
    assert len(s.layers) == 61
    assert all(layer.is_mla and layer.elements_per_token == 512 + 64 for layer in s.layers)


def test_gpt2_aliases_and_mha():
    s = spec("gpt2-xl")
    assert (len(s.layers), s.num_attention_heads, s.num_kv_heads) == (48, 25, 25)
    assert s.layers[0].head_dim == 64  # n_embd 1600 / n_head 25
    assert s.max_position_embeddings == 1024  # n_positions


def test_falcon_multi_query_has_one_kv_head():
    s = spec("falcon-7b")
    assert (s.num_attention_heads, s.num_kv_heads, s.layers[0].head_dim) == (71, 1, 64)
    assert s.max_position_embeddings is None  # the published config has no such field


@pytest.mark.parametrize("changes, expected", [
    ({"multi_query": False}, 71),
    ({"new_decoder_architecture": True, "num_kv_heads": 8}, 8),
])
def test_falcon_kv_head_rules(changes, expected):
    cfg = load("falcon-7b")
    cfg.update(changes)
    assert spec_from_config(cfg).num_kv_heads == expected


def test_jamba_counts_only_attention_layers_and_reports_mamba_state():
    s = spec("jamba-1.5-mini")
    assert [layer.index for layer in s.layers] == [4, 12, 20, 28]  # 1 attention : 7 Mamba
    assert s.num_hidden_layers == 32
    r = s.recurrent
    assert (r.num_layers, r.inner_dim, r.conv_kernel, r.state_size) == (28, 8192, 4, 16)
    assert r.elements == 28 * 8192 * (4 + 16)


def test_unfamiliar_architecture_without_kv_heads_is_refused_unless_overridden():
    cfg = {"model_type": "mystery", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64}
    with pytest.raises(ConfigError, match=r"^num_key_value_heads: .*--num-kv-heads"):
        spec_from_config(cfg)
    assert spec_from_config(cfg, num_kv_heads=2).num_kv_heads == 2


def test_override_must_be_positive():
    with pytest.raises(ConfigError, match="^--num-kv-heads: "):
        spec("llama-3-8b", num_kv_heads=0)


def test_unfamiliar_architecture_with_a_window_is_refused():
    cfg = {"model_type": "mystery", "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "hidden_size": 64, "sliding_window": 16}
    with pytest.raises(ConfigError, match="^sliding_window: "):
        spec_from_config(cfg)


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", None), ("num_hidden_layers", 0), ("num_attention_heads", "32"),
    ("hidden_size", True),
])
def test_missing_or_malformed_fields_are_named(field, value):
    cfg = load("llama-3-8b")
    cfg[field] = value
    with pytest.raises(ConfigError, match=f"^{field}: "):
        spec_from_config(cfg)


def test_head_dim_must_divide_when_derived():
    cfg = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 3,
           "hidden_size": 64}
    with pytest.raises(ConfigError, match="^head_dim: "):
        spec_from_config(cfg)


def test_reads_a_path_a_directory_or_a_dict(tmp_path, write_config):
    cfg = load("llama-3-8b")
    assert spec_from_config(write_config(cfg)) == spec_from_config(cfg)
    assert spec_from_config(tmp_path) == spec_from_config(cfg)  # directory with config.json


def test_unreadable_config_is_a_config_error(tmp_path, write_config):
    with pytest.raises(ConfigError, match="^config.json: cannot read"):
        spec_from_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^config.json: "):
        spec_from_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="not a JSON object"):
        spec_from_config(write_config([1, 2]))


def test_composite_config_uses_text_config():
    outer = {"model_type": "llava", "text_config": load("llama-3-8b")}
    assert spec_from_config(outer).layers == spec("llama-3-8b").layers


def test_qwen3_0_6b_explicit_head_dim():
    s = spec("qwen3-0.6b")
    assert (s.num_attention_heads, s.num_kv_heads, s.layers[0].head_dim) == (16, 8, 128)
    assert 1024 // 16 == 64  # what hidden_size / heads would have said
    assert s.windows == (None,) * 28 and s.max_position_embeddings == 40960


def test_gemma_3_1b_every_sixth_layer_global_with_head_dim_256():
    s = spec("gemma-3-1b-it")
    assert (len(s.layers), s.num_kv_heads, s.layers[0].head_dim) == (26, 1, 256)
    assert [i for i, w in enumerate(s.windows) if w is None] == [5, 11, 17, 23]
    assert set(s.windows) == {512, None}
    listed = {**load("gemma-3-1b-it"), "layer_types": [  # transformers 5.x writes the list
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]}
    assert spec_from_config(listed).windows == s.windows


def test_phi_4_mini_longrope_serves_its_original_context():
    """LongRoPE with distinct short and long factors: the served (and budgeted) context is
    original_max_position_embeddings, not max_position_embeddings (model_spec docstring)."""
    cfg = load("phi-4-mini-instruct")
    assert (cfg["max_position_embeddings"], cfg["original_max_position_embeddings"]) == (131072, 4096)
    s = spec("phi-4-mini-instruct")
    assert s.max_position_embeddings == 4096
    assert (s.num_kv_heads, s.layers[0].head_dim) == (8, 128)
    assert s.windows == (262144,) * 32  # Phi-3's window applies to every layer
    same = {**cfg, "rope_scaling": {**cfg["rope_scaling"],
                                    "long_factor": cfg["rope_scaling"]["short_factor"]}}
    assert spec_from_config(same).max_position_embeddings == 131072
    no_original = {k: v for k, v in cfg.items() if k != "original_max_position_embeddings"}
    with pytest.raises(ConfigError, match="^original_max_position_embeddings: "):
        spec_from_config(no_original)
