"""KV-cache bytes of a :class:`ModelKVSpec`: the payload formula, dtypes, tensor-parallel ranks.

The formula (reference lesson, "Derive the exact byte formula"): per request of ``T`` tokens,

    bytes = sum over attention layers l of  retained_l(T) * elements_l * s

with ``elements_l = 2 * Hkv * head_dim`` (K and V) for an ordinary layer and
``kv_lora_rank + qk_rope_head_dim`` (one latent, no factor 2) for an MLA layer,
``retained_l(T) = min(T, window_l)`` and ``s`` bytes per stored element. Requests of unequal
length are summed. Everything here is *payload*: quantization scales are reported by
:func:`scale_bytes_per_token` and never mixed in, and a hybrid model's recurrent state is its own
term (:func:`recurrent_state_bytes`).

Per rank (docs/design.md §3, "Tensor-parallel sharding"): pass ``rank_spec(spec, tp)`` to any function here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from kvfleet.allocator.model_spec import AttentionLayer, ModelKVSpec

KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
SCALED_DTYPES = frozenset({"fp8"})
SCALE_BYTES = 4  # one float32 scale
"""Scale layout counted for fp8: one float32 scale per token per KV head for K and one for V
(one per token for an MLA latent) — the finest common granularity, so the figure is an upper
bound for kernels that keep one scale per tensor."""


class DtypeError(ValueError):
    """An unknown storage dtype; the message names the flag."""


class ShardingError(ValueError):
    """Heads (or recurrent state) that do not split over ``tp`` ranks; ``field`` names them."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def dtype_bytes(dtype: str, name: str = "--kv-dtype") -> int:
    """Bytes per stored element of ``fp32`` (4), ``fp16`` / ``bf16`` (2) or ``fp8`` (1).

    Raises:
        DtypeError: any other name; the message starts with ``name``.
    """
    try:
        return KV_DTYPE_BYTES[dtype]
    except KeyError:
        choices = "|".join(KV_DTYPE_BYTES)
        raise DtypeError(f"{name}: unknown dtype {dtype!r} (choose {choices})") from None


def kv_heads_per_rank(num_kv_heads: int, num_attention_heads: int, tp: int) -> int:
    """KV heads each of ``tp`` ranks holds (docs/design.md §3).

    ``num_kv_heads % tp == 0``: split, ``num_kv_heads // tp`` each. ``tp % num_kv_heads == 0``:
    replicated ``tp // num_kv_heads`` times, so every rank still holds one whole head (per-rank
    bytes do not shrink below one head). Query heads must split evenly.

    Raises:
        ShardingError: ``tp`` < 1 (field ``--tp``), query heads not divisible by ``tp``
            (field ``num_attention_heads``), or KV heads neither split nor replicate evenly
            (field ``num_key_value_heads``).
    """
    refusal = head_split_refusal(num_kv_heads, num_attention_heads, tp)
    if refusal is not None:
        field, reason = refusal
        works = ", ".join(map(str, valid_tp_sizes(num_kv_heads, num_attention_heads)))
        raise ShardingError(field, f"{reason} ({num_attention_heads} query / {num_kv_heads} KV "
                                   f"heads; tp sizes that work: {works})")
    return num_kv_heads // tp if num_kv_heads % tp == 0 else 1


def head_split_refusal(num_kv_heads: int, num_attention_heads: int,
                       tp: int) -> tuple[str, str] | None:
    """Why the heads cannot split over ``tp`` — ``(field, reason)`` — or None when they can
    (the rules of :func:`kv_heads_per_rank`)."""
    if tp < 1:
        return "--tp", f"must be a positive integer, got {tp}"
    if num_attention_heads % tp:
        return "num_attention_heads", f"{num_attention_heads} query heads do not split over tp={tp}"
    if num_kv_heads % tp and tp % num_kv_heads:
        return ("num_key_value_heads",
                f"{num_kv_heads} KV heads neither split over nor replicate to tp={tp}")
    return None


def valid_tp_sizes(num_kv_heads: int, num_attention_heads: int) -> list[int]:
    """Every ``tp`` that :func:`kv_heads_per_rank` accepts: it divides the query heads, and
    the KV heads split over it or replicate to it."""
    return [tp for tp in range(1, num_attention_heads + 1)
            if head_split_refusal(num_kv_heads, num_attention_heads, tp) is None]


def _rank_layer(layer: AttentionLayer, num_attention_heads: int, tp: int) -> AttentionLayer:
    if layer.is_mla:
        return layer  # the MLA latent is shared by all heads: every rank keeps all of it
    return replace(layer, num_kv_heads=kv_heads_per_rank(layer.num_kv_heads,
                                                         num_attention_heads, tp))


def rank_spec(spec: ModelKVSpec, tp: int) -> ModelKVSpec:
    """The part of ``spec`` that one of ``tp`` tensor-parallel ranks holds.

    Ordinary layers: KV heads split or replicated (:func:`kv_heads_per_rank`). MLA latents:
    replicated. Mamba state: split over its inner dimension (column-parallel ``in_proj``).

    Raises:
        ShardingError: see :func:`kv_heads_per_rank`; a Mamba inner dimension that does not
            split evenly (field ``mamba_expand``).
    """
    kv_heads_per_rank(max(spec.num_kv_heads, 1), spec.num_attention_heads, tp)  # validates tp
    if tp == 1:
        return spec
    layers = tuple(_rank_layer(layer, spec.num_attention_heads, tp) for layer in spec.layers)
    recurrent = spec.recurrent
    if recurrent is not None:
        if recurrent.inner_dim % tp:
            raise ShardingError("mamba_expand", f"Mamba inner dimension {recurrent.inner_dim} "
                                                f"does not split over tp={tp}")
        recurrent = replace(recurrent, inner_dim=recurrent.inner_dim // tp)
    return replace(spec, layers=layers, recurrent=recurrent)


def bytes_per_token(spec: ModelKVSpec, kv_dtype: str = "bf16") -> int:
    """Payload bytes one more token adds over all attention layers, at a context within every
    window: ``sum_l elements_l * s`` (Llama-3-8B, bf16: 2 * 32 * 8 * 128 * 2 = 131072)."""
    return sum(layer.elements_per_token for layer in spec.layers) * dtype_bytes(kv_dtype)


def scales_per_token(layer: AttentionLayer) -> int:
    """Scales one token needs in ``layer`` under a scaled dtype: one per KV head for K and one
    for V, or one for an MLA latent."""
    return 1 if layer.is_mla else 2 * layer.num_kv_heads


def scale_bytes_per_token(spec: ModelKVSpec, kv_dtype: str = "bf16") -> int:
    """Scale metadata bytes per token for a scaled dtype (fp8), 0 otherwise (see SCALE_BYTES)."""
    dtype_bytes(kv_dtype)  # refuse an unknown dtype here too
    if kv_dtype not in SCALED_DTYPES:
        return 0
    return sum(scales_per_token(layer) for layer in spec.layers) * SCALE_BYTES


def _check_tokens(num_tokens: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"number of tokens must be >= 0, got {num_tokens}")


def request_kv_bytes(spec: ModelKVSpec, num_tokens: int, kv_dtype: str = "bf16") -> int:
    """Payload bytes of one request of ``num_tokens`` tokens, each layer's window applied:
    ``sum_l min(T, window_l) * elements_l * s``."""
    _check_tokens(num_tokens)
    elements = sum(layer.retained_tokens(num_tokens) * layer.elements_per_token
                   for layer in spec.layers)
    return elements * dtype_bytes(kv_dtype)


def request_scale_bytes(spec: ModelKVSpec, num_tokens: int, kv_dtype: str = "bf16") -> int:
    """Scale metadata bytes of one request (0 unless ``kv_dtype`` needs scales)."""
    _check_tokens(num_tokens)
    if scale_bytes_per_token(spec, kv_dtype) == 0:
        return 0
    scales = sum(layer.retained_tokens(num_tokens) * scales_per_token(layer)
                 for layer in spec.layers)
    return scales * SCALE_BYTES


def kv_bytes(spec: ModelKVSpec, lengths: Iterable[int], kv_dtype: str = "bf16") -> int:
    """Payload bytes of several requests of (possibly unequal) token ``lengths``, summed."""
    return sum(request_kv_bytes(spec, n, kv_dtype) for n in lengths)


def recurrent_state_bytes(spec: ModelKVSpec, dtype: str = "bf16") -> int:
    """Bytes of one request's fixed recurrent (Mamba) state, 0 for a model without one.

    Counted at ``dtype`` (by default the KV dtype); some kernels keep the SSM part in fp32.
    """
    if spec.recurrent is None:
        return 0
    return spec.recurrent.elements * dtype_bytes(dtype)
