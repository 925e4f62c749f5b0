"""The decoder families the engine runs natively, keyed by ``config.json``'s ``model_type``:
each family's architectures, the module that builds it, its defaults, what it changes in the
Llama decoder (:class:`DecoderStyle`) and its RoPE, read from its HuggingFace config fields
(both transformers 4.x and 5.x names). Torch-free: ``kvfleet up`` checks a model directory
against these rules before anything starts.

Adding a family: a :class:`Family` entry in :data:`FAMILIES` (docs/models.md lists what the
tests then ask of it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.allocator.model_spec import ConfigError, rope_parameters


class UnsupportedModel(ValueError):
    """The checkpoint uses an architecture or feature the engine does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``linear``: every frequency ÷ ``factor``. ``llama3``: long wavelengths ÷ ``factor`` with a
    smooth ramp between ``low_freq_factor`` and ``high_freq_factor``. ``longrope`` (Phi-3's
    ``su``): frequency ``i`` ÷ ``short_factor[i]`` and cos/sin × ``attention_factor``; the long
    factors apply only past ``original_max_position_embeddings``, which the served context
    never reaches (see :func:`kvfleet.allocator.model_spec.served_context`). ``yarn``: each
    frequency blends its original and its ÷ ``factor`` value along a ramp between the dims
    that turn ``beta_fast`` and ``beta_slow`` times over ``original_max_position_embeddings``
    (bounds rounded outwards when ``truncate``), and cos/sin × ``attention_factor``.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: base ``theta``, optional ``scaling``, and ``rotary_dim`` (the
    leading dims of each head it rotates; the head's other dims pass through, Phi's
    ``partial_rotary_factor``)."""

    theta: float
    rotary_dim: int
    scaling: RopeScaling | None = None


@dataclass(frozen=True)
class DecoderStyle:
    """What a family changes in the Llama decoder; every field at its default is Llama.

    ``qk_norm``: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
    ``norm_offset``: norms scale by ``1 + w`` in fp32 before the cast (Gemma).
    ``sandwich_norms``: a norm on the attention output and on the MLP output too, before each
    residual add (Gemma 2/3: four norms a layer).
    ``embed_scale``: embeddings × ``sqrt(hidden_size)``, rounded to the model dtype (Gemma).
    ``activation``: the gated MLP's: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU).
    ``attn_scale``: the softmax scale (None: ``head_dim ** -0.5``; Gemma:
    ``query_pre_attn_scalar ** -0.5``).
    ``final_logit_softcap``: logits = ``c * tanh(logits / c)`` (None: off).
    ``attn_sinks``: each attention head has a learned logit that joins every softmax's
    denominator (gpt-oss): the weights over the keys then sum to less than 1.
    """

    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    activation: str = "silu"
    attn_scale: float | None = None
    final_logit_softcap: float | None = None
    attn_sinks: bool = False


@dataclass(frozen=True)
class MoeSpec:
    """A sparse mixture-of-experts MLP: which layers have it and how it routes.

    ``num_experts`` experts of width ``intermediate_size`` each; every token runs
    ``top_k`` of them. ``router``: ``softmax_topk`` (softmax over all experts, then the top-k
    probabilities, renormalised to sum to 1 when ``norm_topk_prob``: Qwen3-MoE, Mixtral) or
    ``topk_softmax`` (the top-k logits, then a softmax over those: gpt-oss). ``sparse[i]``:
    whether layer ``i`` holds the sparse block (else the dense MLP of the config's
    ``intermediate_size``). ``prefix``: the checkpoint module of the block
    (``model.layers.{i}.<prefix>.``). ``bias``: router and experts carry biases (gpt-oss).
    ``swiglu_limit`` / ``swiglu_alpha``: gpt-oss's clamped SwiGLU
    (``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``); None:
    the family's plain gated activation.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str
    norm_topk_prob: bool
    sparse: tuple[bool, ...]
    prefix: str = "mlp"
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


def _number(params: Mapping[str, Any], name: str, where: str) -> float:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where}.{name}", f"must be a positive number, got {value!r}")
    return float(value)


def _factors(params: Mapping[str, Any], name: str, n: int) -> tuple[float, ...]:
    value = params.get(name)
    if not isinstance(value, list) or len(value) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value):
        raise ConfigError(f"rope_scaling.{name}", f"must list {n} positive numbers (one per "
                                                  f"rotated frequency), got {value!r}")
    return tuple(float(v) for v in value)


def _longrope(params: Mapping[str, Any], raw: Mapping[str, Any], rotary_dim: int) -> RopeScaling:
    """Phi-3's LongRoPE as transformers computes it: ``factor`` defaults to
    ``max_position_embeddings / original_max_position_embeddings`` and ``attention_factor`` to
    ``sqrt(1 + ln(factor) / ln(original))`` (1 when the factor is at most 1)."""
    short = _factors(params, "short_factor", rotary_dim // 2)
    _factors(params, "long_factor", rotary_dim // 2)
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 1:
        raise ConfigError("original_max_position_embeddings",
                          f"LongRoPE needs it as an integer > 1, got {original!r}")
    factor = (_number(params, "factor", "rope_scaling") if params.get("factor") is not None
              else int(raw["max_position_embeddings"]) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       short_factor=short, attention_factor=float(attention))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: Mapping[str, Any], raw: Mapping[str, Any]) -> RopeScaling:
    """YaRN as transformers computes it: ``factor`` defaults to ``max_position_embeddings /
    original_max_position_embeddings``; ``attention_factor`` to ``0.1 ln(factor) + 1`` (or the
    ratio of the two ``mscale`` terms where ``mscale`` and ``mscale_all_dim`` are set)."""
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 1:
        raise ConfigError("rope_scaling.original_max_position_embeddings",
                          f"YaRN needs it as an integer > 1, got {original!r}")
    factor = (_number(params, "factor", "rope_scaling") if params.get("factor") is not None
              else int(raw["max_position_embeddings"]) / original)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                       attention_factor=float(attention),
                       beta_fast=float(params.get("beta_fast") or 32.0),
                       beta_slow=float(params.get("beta_slow") or 1.0),
                       truncate=bool(params.get("truncate", True)))


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def parse_rope(params: Mapping[str, Any], raw: Mapping[str, Any], head_dim: int,
               default_theta: float = 10000.0) -> Rope:
    """One :class:`Rope` from RoPE parameters (``rope_type``/``type``, ``rope_theta``,
    ``factor``, …); ``raw`` supplies what 4.x configs keep at the top level (``rope_theta``,
    ``partial_rotary_factor``, ``original_max_position_embeddings``).

    Raises:
        UnsupportedModel: a RoPE type other than :data:`ROPE_TYPES` (``su`` is ``longrope``).
        ConfigError: a malformed RoPE field (the message names it).
    """
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError("partial_rotary_factor", f"{partial!r} of head_dim {head_dim} must "
                                                   "rotate an even number of dims")
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"rope_scaling.rope_type: {rope_type!r} is not supported "
                               f"({', '.join(ROPE_TYPES)})")
    scaling = None
    if rope_type == "longrope":
        scaling = _longrope(params, raw, rotary_dim)
    elif rope_type == "yarn":
        scaling = _yarn(params, raw)
    elif rope_type != "default":
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=_number(params, "factor", "rope_scaling"),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get(
                "original_max_position_embeddings", raw["max_position_embeddings"])),
        )
    return Rope(theta, rotary_dim, scaling)


def _one_rope(raw: Mapping[str, Any], head_dim: int) -> tuple[Rope, Rope | None]:
    return parse_rope(rope_parameters(raw), raw, head_dim), None


def _gemma3_ropes(raw: Mapping[str, Any], head_dim: int) -> tuple[Rope, Rope | None]:
    """Full-attention layers: ``rope_theta`` (default 1e6) with ``rope_scaling``; sliding
    layers: ``rope_local_base_freq`` (default 1e4), unscaled. transformers 5.x writes both as
    ``rope_parameters`` keyed by layer type."""
    nested = raw.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full, local = nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
    else:
        full = dict(raw.get("rope_scaling") or {})
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    return (parse_rope(full, raw, head_dim, 1_000_000.0),
            parse_rope(local, raw, head_dim, 10_000.0))


def _activation(raw: Mapping[str, Any], allowed: str, *fields: str) -> str:
    name = next((f for f in fields if raw.get(f) is not None), fields[0])
    act = raw.get(name, allowed)
    if act != allowed:
        raise UnsupportedModel(f"{name}: {act!r} is not supported for model_type "
                               f"{raw.get('model_type')!r} ({allowed} only)")
    return act


def _refuse_set(raw: Mapping[str, Any], *names: str) -> None:
    for name in names:
        if raw.get(name):
            raise UnsupportedModel(f"{name}: {raw[name]!r} is not supported (the engine runs "
                                   f"this family with it unset)")


def _llama_style(raw: Mapping[str, Any]) -> DecoderStyle:
    return DecoderStyle(activation=_activation(raw, "silu", "hidden_act"))


def _qwen3_style(raw: Mapping[str, Any]) -> DecoderStyle:
    return DecoderStyle(qk_norm=True, activation=_activation(raw, "silu", "hidden_act"))


def _gemma3_style(raw: Mapping[str, Any]) -> DecoderStyle:
    """Attention logit soft-capping would need a tanh inside every attention kernel (Gemma 3's
    published configs leave it unset): refused, as is bidirectional attention."""
    _refuse_set(raw, "attn_logit_softcapping", "use_bidirectional_attention")
    scalar = _number({"query_pre_attn_scalar": raw.get("query_pre_attn_scalar", 256)},
                     "query_pre_attn_scalar", "config")
    cap = raw.get("final_logit_softcapping")
    return DecoderStyle(
        qk_norm=True, norm_offset=True, sandwich_norms=True, embed_scale=True,
        activation=_activation(raw, "gelu_pytorch_tanh", "hidden_activation", "hidden_act"),
        attn_scale=scalar ** -0.5,
        final_logit_softcap=None if cap is None else _number(raw, "final_logit_softcapping", "config"),
    )


def _gpt_oss_style(raw: Mapping[str, Any]) -> DecoderStyle:
    return DecoderStyle(attn_sinks=True)


def _count(raw: Mapping[str, Any], *names: str) -> int:
    """The first of ``names`` the config sets, as a positive integer (the error names the first)."""
    name = next((n for n in names if raw.get(n) is not None), names[0])
    value = raw.get(name)
    if value is None:
        raise ConfigError(name, "missing from config.json (a mixture-of-experts model needs it)")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")
    return value


def _experts(raw: Mapping[str, Any], *names: str) -> tuple[int, int]:
    """``(num_experts, num_experts_per_tok)``, refusing a top-k above the expert count."""
    experts, top_k = _count(raw, *names), _count(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ConfigError("num_experts_per_tok", f"{top_k} exceeds the {experts} experts "
                                                 f"({names[0]})")
    return experts, top_k


def _layers(raw: Mapping[str, Any]) -> int:
    return _count(raw, "num_hidden_layers")


def _qwen3_moe(raw: Mapping[str, Any]) -> MoeSpec:
    """Layer ``i`` is sparse unless listed in ``mlp_only_layers``, and only when
    ``(i + 1) % decoder_sparse_step == 0`` (transformers' rule)."""
    experts, top_k = _experts(raw, "num_experts", "num_local_experts")
    step = _count({"decoder_sparse_step": raw.get("decoder_sparse_step", 1)}, "decoder_sparse_step")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError("mlp_only_layers", f"must list layer indices, got {dense!r}")
    return MoeSpec(experts, top_k, _count(raw, "moe_intermediate_size"), "softmax_topk",
                   bool(raw.get("norm_topk_prob", False)),
                   tuple(i not in dense and (i + 1) % step == 0 for i in range(_layers(raw))))


def _mixtral_moe(raw: Mapping[str, Any]) -> MoeSpec:
    experts, top_k = _experts(raw, "num_local_experts")
    return MoeSpec(experts, top_k, _count(raw, "intermediate_size"), "softmax_topk", True,
                   (True,) * _layers(raw), prefix="block_sparse_moe")


def _gpt_oss_moe(raw: Mapping[str, Any]) -> MoeSpec:
    experts, top_k = _experts(raw, "num_local_experts")
    limit = _number({"swiglu_limit": raw.get("swiglu_limit", 7.0)}, "swiglu_limit", "config")
    alpha = _number({"swiglu_alpha": raw.get("swiglu_alpha", 1.702)}, "swiglu_alpha", "config")
    return MoeSpec(experts, top_k, _count(raw, "intermediate_size"), "topk_softmax", False,
                   (True,) * _layers(raw), bias=True, swiglu_limit=limit, swiglu_alpha=alpha)


def _no_moe(raw: Mapping[str, Any]) -> MoeSpec | None:
    return None


@dataclass(frozen=True)
class Family:
    """One natively run family (``model_type`` is its key in :data:`FAMILIES`).

    ``module``: the model module whose ``build_model`` builds it; ``defaults``: what its
    HuggingFace config class defaults when ``config.json`` omits a field (``qkv_bias``,
    ``o_bias`` for ``attention_bias``); ``style`` and ``ropes`` read its decoder changes and
    ``(rope, local_rope)`` from the raw config (refusing what the engine cannot run);
    ``moe`` its mixture-of-experts block (None: dense MLPs only).
    """

    model_type: str
    architectures: tuple[str, ...]
    module: str = "kvfleet.worker.runner.models.llama"
    defaults: Mapping[str, Any] = field(default_factory=dict)
    style: Callable[[Mapping[str, Any]], DecoderStyle] = _llama_style
    ropes: Callable[[Mapping[str, Any], int], tuple[Rope, Rope | None]] = _one_rope
    moe: Callable[[Mapping[str, Any]], MoeSpec | None] = _no_moe


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", ("LlamaForCausalLM",)),
    Family("mistral", ("MistralForCausalLM",)),
    Family("qwen2", ("Qwen2ForCausalLM",), defaults={"qkv_bias": True, "o_bias": False}),
    Family("qwen3", ("Qwen3ForCausalLM",), style=_qwen3_style),
    Family("gemma3_text", ("Gemma3ForCausalLM",), defaults={"tie_word_embeddings": True},
           style=_gemma3_style, ropes=_gemma3_ropes),
    Family("phi3", ("Phi3ForCausalLM",), defaults={"rms_norm_eps": 1e-5}),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), style=_qwen3_style, moe=_qwen3_moe),
    Family("mixtral", ("MixtralForCausalLM",), defaults={"rms_norm_eps": 1e-5}, moe=_mixtral_moe),
    Family("gpt_oss", ("GptOssForCausalLM",), style=_gpt_oss_style, moe=_gpt_oss_moe,
           defaults={"qkv_bias": True, "o_bias": True, "rms_norm_eps": 1e-5}),
)}

# Fields of composite checkpoints whose extra towers the engine does not run.
_TOWERS = ("vision_config", "audio_config")


def supported_families() -> str:
    """``model_type (Architecture), …`` of every family in :data:`FAMILIES`, for messages."""
    return ", ".join(f"{t} ({', '.join(f.architectures)})" for t, f in sorted(FAMILIES.items()))


def refuse_towers(raw: Mapping[str, Any]) -> None:
    """Refuse a composite (vision / audio) checkpoint, whichever implementation would run it.

    Raises:
        UnsupportedModel: naming the tower's field and the text-only families that work.
    """
    tower = next((t for t in _TOWERS if raw.get(t) is not None), None)
    if tower is not None:
        raise UnsupportedModel(f"{tower}: multimodal checkpoints ({raw.get('model_type')!r}) are "
                               f"not supported; text-only families that work: "
                               f"{supported_families()}")


def family_of(raw: Mapping[str, Any]) -> tuple[Family, str]:
    """``(family, architecture)`` of a raw ``config.json`` (a config without ``model_type``
    is matched by its ``architectures``).

    Raises:
        UnsupportedModel: a vision/audio tower, an unknown ``model_type``, or an architecture
            its family does not build; the message names the field and the families that work.
    """
    _refuse_set(raw, "mlp_bias")
    refuse_towers(raw)
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not model_type:
        family = next((f for f in FAMILIES.values() if set(archs) & set(f.architectures)), None)
    else:
        family = FAMILIES.get(str(model_type))
    if family is None:
        name = "model_type" if model_type else "architectures"
        shown = model_type if model_type else archs
        raise UnsupportedModel(f"{name}: {shown!r} is not supported; families that work: "
                               f"{supported_families()}")
    if not archs:
        return family, family.architectures[0]
    if archs[0] not in family.architectures:
        raise UnsupportedModel(f"architectures: {archs[0]!r} is not supported for model_type "
                               f"{family.model_type!r} ({', '.join(family.architectures)})")
    return family, archs[0]
