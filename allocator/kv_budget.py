"""The KV budget: how many requests a replica's KV memory holds, per tensor-parallel rank.

Reference lesson, "From payload bytes to admission capacity": the memory left for KV is the
usable memory of a device minus its share of the weights, minus a *measured* non-KV reserve
(activations, workspaces, graphs, runtime) and a safety margin. There is no built-in overhead
constant: the reserve is an input, default 0. Each live request reserves
``block_size * ceil(T / block_size)`` token slots; the slots past its ``T`` tokens are tail
waste.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Sequence

from kvfleet.allocator.kv_bytes import (
    KV_DTYPE_BYTES,
    SCALE_BYTES,
    bytes_per_token,
    dtype_bytes,
    rank_spec,
    recurrent_state_bytes,
    scale_bytes_per_token,
    scales_per_token,
)
from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.allocator.model_spec import ModelKVSpec
from kvfleet.allocator.units import cdiv


class CapacityError(ValueError):
    """A budget input out of range; the message names the flag."""


@dataclass(frozen=True)
class Reservation:
    """Token slots reserved for some live requests versus tokens they actually hold."""

    reserved_tokens: int
    live_tokens: int

    @property
    def tail_waste_tokens(self) -> int:
        return self.reserved_tokens - self.live_tokens


def reserve_slots(lengths: Iterable[int], block_size: int) -> Reservation:
    """Slots reserved by requests of ``lengths`` tokens: ``sum block_size * ceil(T / block_size)``.

    Block size 4, requests of 5 and 3 tokens: 12 slots for 8 live tokens (4 wasted).
    """
    if block_size <= 0:
        raise CapacityError(f"--block-size: must be positive, got {block_size}")
    lengths = list(lengths)
    if any(n < 0 for n in lengths):
        raise CapacityError(f"--context: token counts must be >= 0, got {lengths}")
    reserved = sum(block_size * cdiv(n, block_size) for n in lengths)
    return Reservation(reserved_tokens=reserved, live_tokens=sum(lengths))


def group_blocks(windows: Sequence[int | None], num_tokens: int, max_chunk: int,
                 block_size: int) -> tuple[int, ...]:
    """Per layer group (``windows[g]``: its sliding window, None for full attention), the most
    blocks one sequence of ``num_tokens`` tokens holds when computed in chunks of at most
    ``max_chunk`` tokens: ``ceil(T / block_size)`` for a full group; for a sliding group of
    window ``w``, ``min(ceil(T / block_size), ceil((w - 1 + C) / block_size) + 1)`` with
    ``C = min(max_chunk, T)`` — a chunk writes all its tokens and its first query sees
    ``w - 1`` keys back; one more block for a span that does not start on a block boundary.
    The KV cache manager reserves and reports with this same function.

    Raises:
        CapacityError: a negative ``num_tokens``, or ``max_chunk`` / ``block_size`` below 1.
    """
    if num_tokens < 0:
        raise CapacityError(f"--context: token counts must be >= 0, got {num_tokens}")
    if max_chunk < 1 or block_size < 1:
        raise CapacityError(f"--max-num-batched-tokens / --block-size: must be >= 1, got "
                            f"{max_chunk} / {block_size}")
    full = cdiv(num_tokens, block_size)
    chunk = min(max_chunk, num_tokens)
    return tuple(full if w is None else min(full, cdiv(w - 1 + chunk, block_size) + 1)
                 for w in windows)


# Weight-only quantized formats (kvfleet --quantization): bits per weight, and the fp16 values
# each group of weights carries (a scale; for int4 also an offset).
QUANTIZED_WEIGHTS = {"int8": (8, 1), "int4": (4, 2)}
WEIGHT_FORMATS = (*KV_DTYPE_BYTES, *QUANTIZED_WEIGHTS)


def weight_bytes(num_params: int, weight_dtype: str = "bf16", group_size: int = 32) -> int:
    """Weight payload of ``num_params`` parameters stored as ``weight_dtype``: a float dtype
    (7e9 bf16: 14 GB) or ``int8`` / ``int4`` with one fp16 scale (int4: and one fp16 offset)
    per ``group_size`` weights (7e9 int4, groups of 32: 4.375 GB).

    Raises:
        CapacityError: ``num_params`` or ``group_size`` not positive.
        DtypeError: an unknown format (the message names ``--weights``).
    """
    if num_params <= 0:
        raise CapacityError(f"--params: must be positive, got {num_params}")
    if weight_dtype in QUANTIZED_WEIGHTS:
        if group_size <= 0:
            raise CapacityError(f"--quant-group-size: must be positive, got {group_size}")
        bits, values = QUANTIZED_WEIGHTS[weight_dtype]
        return cdiv(num_params * bits, 8) + cdiv(num_params, group_size) * 2 * values
    return num_params * dtype_bytes(weight_dtype, "--weights")


def reserved_request_bytes(spec: ModelKVSpec, num_tokens: int, kv_dtype: str,
                           block_size: int) -> int:
    """Bytes one request of ``num_tokens`` tokens reserves in ``spec`` (pass a per-rank spec):
    each layer's retained span ``min(T, window)`` rounded up to whole blocks, times its payload
    and scale bytes per token, plus the request's fixed recurrent state."""
    s = dtype_bytes(kv_dtype)
    scaled = scale_bytes_per_token(spec, kv_dtype) > 0
    total = 0
    for layer in spec.layers:
        slots = block_size * cdiv(layer.retained_tokens(num_tokens), block_size)
        per_token = layer.elements_per_token * s
        if scaled:
            per_token += scales_per_token(layer) * SCALE_BYTES
        total += slots * per_token
    return total + recurrent_state_bytes(spec, kv_dtype)


def pool_groups(spec: ModelKVSpec) -> LayerGroups | None:
    """The layer groups the engine's pool pages ``spec`` with (:mod:`.layer_groups`), or None
    when it keeps one block of every layer: no sliding layer, or layers whose per-token
    elements differ (MLA, mixed head shapes), which the engine's pages do not split."""
    if spec.recurrent is not None or not spec.layers:
        return None
    if all(layer.window is None for layer in spec.layers):
        return None
    if len({layer.elements_per_token for layer in spec.layers}) != 1:
        return None
    return LayerGroups.from_windows(spec.windows)


def request_pages(groups: LayerGroups, num_tokens: int, block_size: int,
                  max_chunk: int = 1) -> int:
    """Pages one request of ``num_tokens`` tokens holds over every group
    (:func:`group_blocks`; ``max_chunk`` 1: once prefilled, as while it decodes)."""
    return sum(group_blocks(groups.windows, num_tokens, max_chunk, block_size))


@dataclass(frozen=True)
class CapacityPlan:
    """What one rank of a replica can hold. Every ``*_bytes`` field is bytes per rank."""

    tp: int
    block_size: int
    tokens_per_request: int
    memory_bytes: int          # usable memory of one device
    weights_bytes: int         # this rank's share of the weights: ceil(total / tp)
    reserve_bytes: int         # measured non-KV reserve
    margin_bytes: int          # ceil(memory_bytes * margin)
    available_kv_bytes: int    # memory - weights - reserve - margin, floored at 0
    shortfall_bytes: int       # > 0 when weights + reserve + margin exceed the memory
    block_bytes: int           # one block (page) of block_size tokens over every layer of
    #                            one layer group — every layer without groups (+ scales)
    num_blocks: int            # available_kv_bytes // block_bytes
    request_bytes: int         # what one request holds (reserved_request_bytes; with layer
    #                            groups its pages, request_pages, times block_bytes)
    max_concurrent_requests: int  # available_kv_bytes // request_bytes (with groups: whole
    #                               pages, num_blocks // request_pages — the pool's arithmetic)


def _margin_bytes(memory_bytes: int, margin: float | str | Fraction) -> int:
    fraction = Fraction(str(margin)) if isinstance(margin, float) else Fraction(margin)
    if not 0 <= fraction < 1:
        raise CapacityError(f"--margin: must be a fraction in [0, 1), got {margin}")
    return math.ceil(memory_bytes * fraction)


def plan_capacity(spec: ModelKVSpec, *, memory_bytes: int, tokens_per_request: int, tp: int = 1,
                  weights_bytes: int | None = None, num_params: int | None = None,
                  weight_dtype: str = "bf16", kv_dtype: str = "bf16", reserve_bytes: int = 0,
                  margin: float | str | Fraction = 0, block_size: int = 16,
                  quant_group_size: int = 32, max_chunk: int = 1) -> CapacityPlan:
    """Block budget and concurrent-request capacity of one rank.

    ``memory_bytes`` is the usable memory of one device; the weights are ``weights_bytes`` in
    total (or :func:`weight_bytes` of ``num_params`` in ``weight_dtype``, int8 / int4 with
    groups of ``quant_group_size``), split evenly over ``tp`` ranks;
    ``reserve_bytes`` is the measured non-KV reserve per device; ``margin`` a fraction of
    ``memory_bytes`` kept free. Each request holds ``tokens_per_request`` tokens
    (prompt + max_tokens).

    With sliding-window layers (:func:`pool_groups`) the KV is paged as the engine pages it:
    pages of one layer group, each request holding :func:`request_pages` of them (a sliding
    group at most its window; ``max_chunk``: the prefill chunk counted in that span, 1 for
    requests once prefilled).

    Raises:
        CapacityError: a negative size, a margin outside [0, 1), no weights given.
        ShardingError: heads that do not split over ``tp``.
    """
    if memory_bytes <= 0:
        raise CapacityError(f"--memory: must be positive, got {memory_bytes}")
    if reserve_bytes < 0:
        raise CapacityError(f"--reserve: must be >= 0, got {reserve_bytes}")
    if block_size <= 0:
        raise CapacityError(f"--block-size: must be positive, got {block_size}")
    if tokens_per_request <= 0:
        raise CapacityError(f"--context: must be positive, got {tokens_per_request}")
    if weights_bytes is None:
        if num_params is None:
            raise CapacityError("--params: needed with --memory (the weights share the memory)")
        weights_bytes = weight_bytes(num_params, weight_dtype, quant_group_size)
    rank = rank_spec(spec, tp)
    per_rank_weights = cdiv(weights_bytes, tp)
    margin_bytes = _margin_bytes(memory_bytes, margin)
    left = memory_bytes - per_rank_weights - reserve_bytes - margin_bytes
    available = max(0, left)
    block_bytes = block_size * (bytes_per_token(rank, kv_dtype)
                                + scale_bytes_per_token(rank, kv_dtype))
    request_bytes = reserved_request_bytes(rank, tokens_per_request, kv_dtype, block_size)
    groups = pool_groups(rank)
    if groups is not None:
        block_bytes = block_bytes * groups.layers_per_group // groups.num_layers
        pages = request_pages(groups, tokens_per_request, block_size, max_chunk)
        request_bytes = pages * block_bytes
    return CapacityPlan(
        tp=tp, block_size=block_size, tokens_per_request=tokens_per_request,
        memory_bytes=memory_bytes, weights_bytes=per_rank_weights, reserve_bytes=reserve_bytes,
        margin_bytes=margin_bytes, available_kv_bytes=available, shortfall_bytes=max(0, -left),
        block_bytes=block_bytes, num_blocks=available // block_bytes if block_bytes else 0,
        request_bytes=request_bytes,
        max_concurrent_requests=available // request_bytes if request_bytes else 0,
    )
