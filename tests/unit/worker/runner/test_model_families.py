"""Each native family's config.json read as the engine runs it (the published configs in
tests/fixtures/configs/), and what is refused, by name, before anything loads."""

from __future__ import annotations

import importlib
import json
import math

import pytest

from kvfleet.allocator.model_spec import ConfigError
from kvfleet.worker.runner.model_config import DecoderStyle, UnsupportedModel, parse_model_config
from kvfleet.worker.runner.model_families import FAMILIES, supported_families
from kvfleet.worker.runner.models import REGISTRY
from tests.unit.allocator.conftest import load


def test_every_family_is_registered_with_a_module_that_builds_it() -> None:
    assert set(REGISTRY) == {a for f in FAMILIES.values() for a in f.architectures}
    for family in FAMILIES.values():
        assert callable(importlib.import_module(family.module).build_model)
    assert "qwen3 (Qwen3ForCausalLM)" in supported_families()


def test_qwen3_0_6b() -> None:
    c = parse_model_config(load("qwen3-0.6b"))
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim) == ("Qwen3ForCausalLM", 16, 8, 128)
    assert c.style == DecoderStyle(qk_norm=True)
    assert not c.qkv_bias and not c.o_bias and c.tie_word_embeddings
    assert c.rope.theta == 1e6 and c.rope.rotary_dim == 128 and c.local_rope is None
    assert c.max_position_embeddings == 40960 and c.eos_token_ids == (151645,)


def test_gemma_3_1b() -> None:
    c = parse_model_config(load("gemma-3-1b-it"))
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim) == ("Gemma3ForCausalLM", 4, 1, 256)
    s = c.style
    assert s.qk_norm and s.norm_offset and s.sandwich_norms and s.embed_scale
    assert s.activation == "gelu_pytorch_tanh" and s.final_logit_softcap is None
    assert s.attn_scale == 256 ** -0.5
    assert c.tie_word_embeddings  # absent from the file: Gemma3TextConfig's default
    assert (c.rope.theta, c.local_rope.theta) == (1e6, 1e4)
    assert [c.rope_index(i) for i in range(7)] == [1, 1, 1, 1, 1, 0, 1]  # layer 5 is global
    assert c.sliding_windows[4:7] == (512, None, 512) and c.eos_token_ids == (1, 106)


def test_gemma_3_rope_scaling_applies_to_global_layers_only() -> None:
    """Gemma 3 4B and larger scale the global RoPE (linear, 8); 5.x writes it per layer type."""
    old = {**load("gemma-3-1b-it"), "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    new = {k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta",
                                                      "rope_local_base_freq")}
    new["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    for raw in (old, new):
        c = parse_model_config(raw)
        assert c.rope.scaling.rope_type == "linear" and c.rope.scaling.factor == 8.0
        assert c.local_rope.scaling is None and c.local_rope.theta == 1e4


def test_phi_4_mini() -> None:
    raw = load("phi-4-mini-instruct")
    c = parse_model_config(raw)
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim) == ("Phi3ForCausalLM", 24, 8, 128)
    assert c.rope.rotary_dim == 96  # partial_rotary_factor 0.75
    s = c.rope.scaling
    assert s.rope_type == "longrope" and s.short_factor == (1.0,) * 48
    assert s.factor == 131072 / 4096
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert c.max_position_embeddings == 4096  # served within the short factors' range
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5
    su = {**raw, "rope_scaling": {**raw["rope_scaling"], "type": "su"}}
    assert parse_model_config(su).rope == c.rope


def test_llama_3_1_rope() -> None:
    c = parse_model_config(load("llama-3.1-405b"))
    assert c.rope.scaling.rope_type == "llama3" and c.rope.scaling.factor == 8.0
    assert c.style == DecoderStyle()


VISION = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": load("gemma-3-1b-it"), "vision_config": {"model_type": "siglip_vision_model"}}


@pytest.mark.parametrize("raw, error, match", [
    ({**load("qwen3-0.6b"), "model_type": "olmo2"}, UnsupportedModel,
     r"^model_type: 'olmo2' is not supported; families that work: gemma3_text \(Gemma3ForCausalLM\)"),
    ({**load("qwen3-0.6b"), "architectures": ["Qwen3ForSequenceClassification"]}, UnsupportedModel,
     "^architectures: 'Qwen3ForSequenceClassification'"),
    (VISION, UnsupportedModel, "^vision_config: multimodal checkpoints"),
    (load("deepseek-v3"), UnsupportedModel, "^model_type: 'deepseek_v3'"),
    ({**load("llama-3-8b"), "kv_lora_rank": 512, "qk_rope_head_dim": 64}, UnsupportedModel,
     "^kv_lora_rank: MLA"),
    (load("jamba-1.5-mini"), UnsupportedModel, "^model_type: 'jamba'"),
    ({**load("gemma-3-1b-it"), "attn_logit_softcapping": 50.0}, UnsupportedModel,
     "^attn_logit_softcapping: 50.0 is not supported"),
    ({**load("gemma-3-1b-it"), "use_bidirectional_attention": True}, UnsupportedModel,
     "^use_bidirectional_attention"),
    ({**load("gemma-3-1b-it"), "hidden_activation": "gelu"}, UnsupportedModel,
     "^hidden_activation: 'gelu'"),
    ({**load("qwen3-0.6b"), "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, UnsupportedModel,
     "^rope_scaling.rope_type: 'dynamic'"),
    ({k: v for k, v in load("qwen3-0.6b").items() if k != "hidden_size"}, ConfigError,
     "^hidden_size: missing"),
    ({k: v for k, v in load("gemma-3-1b-it").items() if k != "vocab_size"}, ConfigError,
     "^vocab_size: missing"),
    ({k: v for k, v in load("qwen3-0.6b").items() if k != "max_position_embeddings"}, ConfigError,
     "^max_position_embeddings: missing"),
    ({**load("phi-4-mini-instruct"), "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                                                      "long_factor": [1.0]}}, ConfigError,
     r"^rope_scaling.short_factor: must list 48"),
    ({**load("phi-4-mini-instruct"), "partial_rotary_factor": 0.2}, ConfigError,
     "^partial_rotary_factor"),
])
def test_refused_naming_the_field(raw, error, match) -> None:
    with pytest.raises(error, match=match):
        parse_model_config(json.loads(json.dumps(raw)))
