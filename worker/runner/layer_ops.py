"""A decoder layer's small ops fused in C (``layer_ops.c``): RMSNorm with the residual add,
RoPE with the K/V cache write, and the gated MLP's SiLU · up.

Between its projections a layer runs about a dozen tiny torch ops; at decode sizes each costs
more in dispatch and allocation than in arithmetic, a large share of a quantized decode step.
These calls replace them where :func:`applies` (fp32 on CPU, C kernels loaded); elsewhere the
model keeps its torch formulation, against which the tests compare these.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvfleet.worker.runner import cpu_kernels

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES: dict[str, list[Any]] = {
    "add_rms_norm": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int],
    "rope_write_kv": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int],
    "silu_mul": [_ptr, _i64, _i64, _i64, _ptr, _i64, _int],
}


def load() -> ctypes.CDLL | None:
    """The kernel library with these ops' signatures set, or None where the C kernels are
    unavailable (see :func:`kvfleet.worker.runner.cpu_kernels.load`)."""
    lib = cpu_kernels.load()
    if lib is not None and lib.silu_mul.restype is not None:  # not yet bound
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
    return lib


def applies(x: torch.Tensor) -> bool:
    """Whether the fused ops can run on activations like ``x`` (fp32 CPU, library loaded)."""
    return x.dtype == torch.float32 and x.is_cpu and load() is not None


def _rows(x: torch.Tensor, what: str) -> int:
    """``x``'s row stride, after checking it is rows with unit column stride."""
    stride = x.stride()  # one call for both strides: these wrappers run several times a layer
    if len(stride) != 2 or stride[1] != 1:
        raise ValueError(f"{what}: want rows (T, n) with unit column stride, got "
                         f"{tuple(x.shape)} strides {stride}")
    return stride[0]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` (``delta`` None: ``s = x``, not copied) and ``rms_norm(s) · weight``.

    Args:
        x, delta: ``(T, size)`` fp32 CPU, unit column stride.
        weight: ``(size,)`` contiguous.
        eps: added to the mean square.
        in_place: write ``s`` over ``x`` (the same sum, one allocation less).

    Returns:
        ``(s, normed)``, each ``(T, size)``; ``s`` is a new tensor unless ``delta`` is None or
        ``in_place``.

    Raises:
        ValueError: layouts the kernel cannot read.
    """
    ldx = _rows(x, "add_rms_norm")
    rows, size = x.shape
    if weight.shape != (size,) or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} for rows of {size}")
    normed = torch.empty(rows, size, dtype=torch.float32)
    if delta is None:
        s, lds, b, ldb = x, ldx, None, 0
    else:
        ldb = _rows(delta, "add_rms_norm")
        if delta.shape != x.shape:
            raise ValueError(f"add_rms_norm: {tuple(x.shape)} + {tuple(delta.shape)}")
        s, lds = (x, ldx) if in_place else (torch.empty(rows, size, dtype=torch.float32), size)
        b = delta.data_ptr()
    if rows:
        _lib().add_rms_norm(x.data_ptr(), ldx, b, ldb, s.data_ptr(), lds, weight.data_ptr(),
                            normed.data_ptr(), size, rows, size, eps, torch.get_num_threads())
    return s, normed


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                  kv_heads: int, head_dim: int, key_cache: torch.Tensor | None = None,
                  value_cache: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> None:
    """RoPE in place on the query and key heads of ``qkv``, then (with caches) each row's
    keys and values written to its cache slot.

    Args:
        qkv: ``(T, (heads + 2 * kv_heads) * head_dim)`` fp32 CPU, columns q | k | v, unit
            column stride.
        cos, sin: ``(T, 1, rotary_dim)`` contiguous, half-split layout (dims past
            ``rotary_dim`` are left as they are).
        key_cache, value_cache: ``(num_blocks, block_size, kv_heads, head_dim)`` contiguous.
        slots: ``(T,)`` int64 contiguous, each row's flat cache slot (trusted: the runner
            checked the block tables).

    Raises:
        ValueError: layouts the kernel cannot read.
    """
    ldq = _rows(qkv, "rope_write_kv")
    rows = qkv.shape[0]
    rot = cos.shape[-1]
    if (qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or rot > head_dim or rot % 2
            or cos.shape != (rows, 1, rot) or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"rope_write_kv: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}")
    k = v = s = None
    if key_cache is not None:
        assert value_cache is not None and slots is not None
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()
                and key_cache.shape[2:] == (kv_heads, head_dim) and slots.shape == (rows,)
                and slots.is_contiguous() and slots.dtype == torch.int64):
            raise ValueError("rope_write_kv: caches must be contiguous (.., kv_heads, head_dim)")
        k, v, s = key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr()
    if rows:
        _lib().rope_write_kv(qkv.data_ptr(), ldq, rows, cos.data_ptr(), sin.data_ptr(),
                             heads, kv_heads, head_dim, rot, k, v, s, torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``gate_up`` ``(T, 2 * width)`` fp32 CPU (columns gate | up,
    unit column stride) → ``(T, width)``.

    Raises:
        ValueError: a layout the kernel cannot read.
    """
    ld = _rows(gate_up, "silu_mul")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=torch.float32)
    if rows:
        _lib().silu_mul(gate_up.data_ptr(), ld, rows, width, out.data_ptr(), width,
                        torch.get_num_threads())
    return out


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the C kernels are not loaded (see layer_ops.applies)")
    return lib
