"""Parameter counts read from a decoder's ``config.json`` (torch-free): what the weights
hold, and what one token runs.

A mixture-of-experts model holds every expert (each counted once, in ``total``) but runs only
``num_experts_per_tok`` of them per token (``active``): the memory budget needs ``total``,
a decode step's weight traffic follows ``active``. Counted: embedding, LM head (unless tied),
per layer Q/K/V/O (and their biases where ``attention_bias``), qk-norm and sink vectors, the
norms, and the MLP: dense ``3 * hidden * intermediate`` or, in a sparse layer, the router and
every expert's gate/up/down (with biases for gpt-oss). Families: Llama-style dense decoders
and the sparse layouts of Qwen3-MoE, Mixtral and gpt-oss (their field names).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.allocator.model_spec import ConfigError, _head_dim, _positive_int

# model_type → (expert count field(s), expert width field, router and experts biased).
# Which layers are sparse: Qwen's decoder_sparse_step / mlp_only_layers, else every layer.
_MOE: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "qwen3_moe": (("num_experts", "num_local_experts"), "moe_intermediate_size", False),
    "qwen2_moe": (("num_experts",), "moe_intermediate_size", False),
    "mixtral": (("num_local_experts",), "intermediate_size", False),
    "gpt_oss": (("num_local_experts",), "intermediate_size", True),
}
# Families whose layers carry four norms (Gemma 2/3) or per-head q/k norms.
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
_BIASED_QKV = ("qwen2", "qwen2_moe")


def is_moe(cfg: Mapping[str, Any]) -> bool:
    """Whether :func:`param_count` reads ``cfg`` as a mixture-of-experts model."""
    return str(cfg.get("model_type", "")) in _MOE


@dataclass(frozen=True)
class ParamCount:
    """``total``: every parameter the weights hold (each expert once); ``active``: those one
    token runs (the embedding counted whole, as held)."""

    total: int
    active: int


def _sparse_layers(cfg: Mapping[str, Any], model_type: str, n: int) -> list[bool]:
    if model_type not in ("qwen3_moe", "qwen2_moe"):
        return [True] * n
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def param_count(cfg: Mapping[str, Any]) -> ParamCount:
    """Parameters of the decoder ``cfg`` describes.

    Raises:
        ConfigError: a shape field is missing or malformed, or ``num_experts_per_tok``
            exceeds the expert count (the message names the field).
    """
    model_type = str(cfg.get("model_type", ""))
    h = _positive_int(cfg, "hidden_size")
    v = _positive_int(cfg, "vocab_size")
    n = _positive_int(cfg, "num_hidden_layers")
    heads = _positive_int(cfg, "num_attention_heads")
    kv = _positive_int(cfg, "num_key_value_heads", required=False) or heads
    d = _head_dim(cfg, heads)
    q_out, kv_out = heads * d, kv * d
    attn = h * q_out + 2 * h * kv_out + q_out * h
    bias = cfg.get("attention_bias")
    if bias or (bias is None and model_type in _BIASED_QKV):
        attn += q_out + 2 * kv_out + (h if bias else 0)
    if model_type in _QK_NORM:
        attn += 2 * d
    if model_type == "gpt_oss":
        attn += heads  # sinks
    norms = (4 if model_type in _FOUR_NORMS else 2) * h
    dense_mlp = 3 * h * _positive_int(cfg, "intermediate_size")
    total = active = n * (attn + norms)
    moe = _MOE.get(model_type)
    if moe is None:
        total += n * dense_mlp
        active += n * dense_mlp
    else:
        count_fields, width_field, biased = moe
        experts = _positive_int(cfg, *count_fields)
        top_k = _positive_int(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError("num_experts_per_tok", f"{top_k} exceeds the {experts} experts "
                                                     f"({count_fields[0]})")
        width = _positive_int(cfg, width_field)
        expert = 3 * h * width + (2 * width + h if biased else 0)
        router = h * experts + (experts if biased else 0)
        for sparse in _sparse_layers(cfg, model_type, n):
            total += router + experts * expert if sparse else dense_mlp
            active += router + top_k * expert if sparse else dense_mlp
    tied = cfg.get("tie_word_embeddings", model_type in ("gemma3_text", "gemma3", "gemma2"))
    tables = v * h * (1 if tied else 2) + h  # embedding (+ LM head) + final norm
    return ParamCount(total + tables, active + tables)
