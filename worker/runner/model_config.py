"""A model directory's ``config.json`` (+ ``generation_config.json``) as one frozen spec.

The layer shape (layers, heads, KV heads, head width, per-layer sliding windows) is the
allocator's reading (:func:`kvfleet.allocator.model_spec.spec_from_config`, torch-free and
shared with the router and ``kvfleet budget``): one reader of ``config.json``'s shape, so the
KV budget and the engine cannot disagree on a window. This module adds what only the forward
needs: RoPE, norms, biases, tied embeddings, EOS ids. It reads the HuggingFace field names of
both transformers 4.x (``rope_theta``, ``rope_scaling``) and 5.x (``rope_parameters``).
Anything the engine cannot run faithfully raises :class:`UnsupportedModel` here, at load
time, instead of producing wrong logits later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.allocator.model_spec import ModelKVSpec, spec_from_config


class UnsupportedModel(ValueError):
    """The checkpoint uses an architecture or feature the engine does not implement."""


# config.json ``model_type`` → architecture, for configs that omit ``architectures``.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

# Facts a family hard-codes in its modelling code rather than writing to config.json.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"qkv_bias": True, "o_bias": False},
}

_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` (divide every frequency by ``factor``) or ``llama3``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only checkpoint.

    ``sliding_windows[i]`` is layer ``i``'s window in tokens (a query at position ``p`` sees
    keys ``p - w + 1 .. p``) or ``None`` for full attention. ``eos_token_ids`` merges
    ``generation_config.json`` and ``config.json``, generation config first.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    qkv_bias: bool
    o_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def sliding_window(self) -> int | None:
        """The window of any sliding layer (families here use one size), else ``None``."""
        return next((w for w in self.sliding_windows if w is not None), None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported ({', '.join(_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw["max_position_embeddings"])
        ),
    )
    return theta, scaling


def _attention_shape(raw: dict[str, Any]) -> ModelKVSpec:
    """The allocator's per-layer spec of ``raw``, refused unless every layer is a plain
    (MHA / GQA / MQA) attention layer the engine's decoder runs.

    Raises:
        UnsupportedModel: MLA latents or recurrent (Mamba) layers.
        ConfigError: a shape field is missing or malformed (the message names it).
    """
    kv = spec_from_config(raw)
    if kv.is_mla:
        raise UnsupportedModel("MLA (kv_lora_rank) is not supported")
    if kv.recurrent is not None or len(kv.layers) != kv.num_hidden_layers:
        raise UnsupportedModel("hybrid (non-attention) layers are not supported")
    return kv


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from parsed ``config.json`` (and ``generation_config.json``).

    Raises:
        UnsupportedModel: unknown architecture, activation or RoPE type, MLA or hybrid layers.
        ConfigError: a shape field is missing or malformed (see ``spec_from_config``).
    """
    model_type = raw.get("model_type", "")
    archs = raw.get("architectures") or [ARCHITECTURE_BY_MODEL_TYPE.get(model_type, "")]
    architecture = archs[0]
    if not architecture:
        raise UnsupportedModel(f"config.json names no architecture (model_type {model_type!r})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (silu only)")
    if raw.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias is not supported")
    kv = _attention_shape(raw)
    defaults = _FAMILY_DEFAULTS.get(model_type, {})
    attention_bias = raw.get("attention_bias")
    theta, scaling = _rope(raw)
    eos = list(dict.fromkeys(_ids((generation or {}).get("eos_token_id")) + _ids(raw.get("eos_token_id"))))
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=kv.num_hidden_layers,
        num_heads=kv.num_attention_heads,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.layers[0].head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_windows=kv.windows,
        qkv_bias=bool(attention_bias) if attention_bias is not None else defaults.get("qkv_bias", False),
        o_bias=bool(attention_bias) if attention_bias is not None else defaults.get("o_bias", False),
        eos_token_ids=tuple(eos),
        bos_token_id=raw.get("bos_token_id"),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional) from a directory.

    Raises:
        FileNotFoundError: no ``config.json``.
        UnsupportedModel: see :func:`parse_model_config`.
    """
    d = Path(model_dir)
    raw = json.loads((d / "config.json").read_text())
    gen_path = d / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, generation)
