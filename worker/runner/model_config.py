"""A model directory's ``config.json`` (+ ``generation_config.json``) as one frozen spec.

The layer shape (layers, heads, KV heads, head width, per-layer sliding windows, the served
context) is the allocator's reading (:func:`kvfleet.allocator.model_spec.spec_from_config`,
torch-free and shared with the router and ``kvfleet budget``): one reader of ``config.json``'s
shape, so the KV budget and the engine cannot disagree on a window. This module adds what only
the forward needs: RoPE, norms, biases, tied embeddings, EOS ids, and what a family changes in
the decoder (:class:`DecoderStyle`, read by the family's rules in :mod:`.model_families`). It
reads the HuggingFace field names of both transformers 4.x (``rope_theta``, ``rope_scaling``)
and 5.x (``rope_parameters``). Anything the engine cannot run faithfully raises
:class:`UnsupportedModel` (a missing or malformed field :class:`ConfigError`) here, at load
time, naming the field, instead of producing wrong logits later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet.allocator.model_spec import ConfigError, ModelKVSpec, _positive_int, spec_from_config
from kvfleet.worker.runner.model_families import (
    DecoderStyle,
    MoeSpec,
    Rope,
    RopeScaling,
    UnsupportedModel,
    family_of,
    refuse_towers,
    supported_families,
)
from kvfleet.worker.runner.model_impl import TRANSFORMERS, resolve_impl

__all__ = ["ConfigError", "DecoderStyle", "ModelConfig", "MoeSpec", "Rope", "RopeScaling", "UnsupportedModel",
           "load_model_config", "parse_model_config"]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only checkpoint.

    ``sliding_windows[i]`` is layer ``i``'s window in tokens (a query at position ``p`` sees
    keys ``p - w + 1 .. p``) or ``None`` for full attention. ``rope`` rotates every layer but,
    where the family gives them their own (``local_rope``, Gemma 3), the sliding ones.
    ``max_position_embeddings`` is the context served (the allocator's reading).
    ``eos_token_ids`` merges ``generation_config.json`` and ``config.json``, generation
    config first. ``moe``: the mixture-of-experts block of the family's sparse layers (None:
    every layer has the dense MLP of ``intermediate_size``).
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
    rope: Rope
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    qkv_bias: bool
    o_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    local_rope: Rope | None = None
    style: DecoderStyle = field(default_factory=DecoderStyle)
    moe: MoeSpec | None = None
    # "native": a registered family's module runs it; "transformers": the Hugging Face class
    # does (:mod:`kvfleet.worker.runner.fallback`), and only the shape, EOS ids and context
    # above are read (rope, norms, biases and style keep their defaults, unused).
    impl: str = "native"

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

    @property
    def ropes(self) -> tuple[Rope, ...]:
        """The distinct rotary embeddings, ``rope`` first."""
        return (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)

    def rope_index(self, layer: int) -> int:
        """Which of :attr:`ropes` layer ``layer`` uses."""
        return int(self.local_rope is not None and self.sliding_windows[layer] is not None)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _attention_shape(raw: dict[str, Any]) -> ModelKVSpec:
    """The allocator's per-layer spec of ``raw``, refused unless every layer is a plain
    (MHA / GQA / MQA) attention layer the engine's decoder runs.

    Raises:
        UnsupportedModel: MLA latents or recurrent (Mamba) layers.
        ConfigError: a shape field is missing or malformed (the message names it).
    """
    kv = spec_from_config(raw)
    if kv.is_mla:
        raise UnsupportedModel(f"kv_lora_rank: MLA attention is not supported (families that "
                               f"work: {supported_families()})")
    if kv.recurrent is not None or len(kv.layers) != kv.num_hidden_layers:
        name = "attn_layer_period" if "attn_layer_period" in raw else "layer_types"
        raise UnsupportedModel(f"{name}: hybrid (non-attention) layers are not supported "
                               f"(families that work: {supported_families()})")
    if kv.max_position_embeddings is None:
        raise ConfigError("max_position_embeddings", "missing from config.json")
    return kv


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None,
                       model_impl: str = "native") -> ModelConfig:
    """Build a :class:`ModelConfig` from parsed ``config.json`` (and ``generation_config.json``);
    ``model_impl`` (:data:`~.model_impl.MODEL_IMPLS`): ``native`` applies the family's rules,
    ``transformers`` reads only what the fallback's runner needs (:func:`_fallback_config`),
    ``auto`` the first when the family is registered, else the second.

    Raises:
        UnsupportedModel: unknown ``model_type`` or architecture, a feature the family's rules
            refuse (activation, RoPE type, soft-capped attention, …), MLA, hybrid layers or a
            vision tower; the message names the field and the families that work.
        ConfigError: a required field is missing or malformed (the message names it).
    """
    if resolve_impl(raw, model_impl) == TRANSFORMERS:
        return _fallback_config(raw, generation)
    family, architecture = family_of(raw)
    kv = _attention_shape(raw)
    head_dim = kv.layers[0].head_dim
    defaults = family.defaults
    attention_bias = raw.get("attention_bias")
    rope, local_rope = family.ropes(raw, head_dim)
    eos = _eos_ids(raw, generation)
    return ModelConfig(
        architecture=architecture,
        model_type=str(raw.get("model_type") or family.model_type),
        vocab_size=_positive_int(raw, "vocab_size"),
        hidden_size=_positive_int(raw, "hidden_size"),
        intermediate_size=_positive_int(raw, "intermediate_size"),
        num_layers=kv.num_hidden_layers,
        num_heads=kv.num_attention_heads,
        num_kv_heads=kv.num_kv_heads,
        head_dim=head_dim,
        rope=rope,
        local_rope=local_rope,
        rms_norm_eps=float(raw.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
        max_position_embeddings=int(kv.max_position_embeddings or 0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                         defaults.get("tie_word_embeddings", False))),
        sliding_windows=kv.windows,
        qkv_bias=bool(attention_bias) if attention_bias is not None else defaults.get("qkv_bias", False),
        o_bias=bool(attention_bias) if attention_bias is not None else defaults.get("o_bias", False),
        eos_token_ids=tuple(eos),
        bos_token_id=raw.get("bos_token_id"),
        style=family.style(raw),
        moe=family.moe(raw),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> list[int]:
    return list(dict.fromkeys(_ids((generation or {}).get("eos_token_id"))
                              + _ids(raw.get("eos_token_id"))))


def _fallback_config(raw: dict[str, Any], generation: dict[str, Any] | None) -> ModelConfig:
    """The :class:`ModelConfig` of a model the Hugging Face class runs: the KV shape (the
    allocator's reading), vocabulary, EOS ids and context; the forward's own fields stay in
    the class's config. ``intermediate_size`` is 0 where the config has none.

    Raises:
        UnsupportedModel: MLA latents, hybrid layers (the paged cache holds K and V only).
        ConfigError: a missing or malformed shape field (named).
    """
    refuse_towers(raw)
    kv = _attention_shape(raw)
    head_dim = kv.layers[0].head_dim
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError("architectures", "the transformers implementation needs the model "
                                           "class named in config.json")
    return ModelConfig(
        architecture=str(archs[0]), model_type=str(raw.get("model_type") or archs[0]),
        vocab_size=_positive_int(raw, "vocab_size"),
        hidden_size=_positive_int(raw, "hidden_size"),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_layers=kv.num_hidden_layers, num_heads=kv.num_attention_heads,
        num_kv_heads=kv.num_kv_heads, head_dim=head_dim, rope=Rope(10000.0, head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(kv.max_position_embeddings or 0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_windows=kv.windows, qkv_bias=False, o_bias=False,
        eos_token_ids=tuple(_eos_ids(raw, generation)), bos_token_id=raw.get("bos_token_id"),
        impl=TRANSFORMERS,
    )


def load_model_config(model_dir: str | Path, model_impl: str = "native") -> ModelConfig:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional) from a directory
    (``model_impl``: see :func:`parse_model_config`).

    Raises:
        FileNotFoundError: no ``config.json``.
        ConfigError: ``config.json`` is not a JSON object; see :func:`parse_model_config`.
        UnsupportedModel: see :func:`parse_model_config`.
    """
    d = Path(model_dir)
    path = d / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError("config.json", f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError("config.json", f"{path} is not a JSON object")
    gen_path = d / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, generation, model_impl)
