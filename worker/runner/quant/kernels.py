"""Products with a :class:`~.packed.PackedWeight`: the C kernel (``qgemm.c``) on CPU, a torch
path everywhere else.

The C kernel streams the packed codes once per call for every row of ``x`` (fp32 activations,
fp32 accumulation); it is built with kvfleet's other kernels by
:mod:`kvfleet.worker.runner.cpu_kernels`. The torch path dequantizes the weight and multiplies
(a CUDA device, a non-fp32 activation dtype, or no C compiler): correct, not tuned.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.quant.packed import PackedWeight

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_INT8_ARGS: list[Any] = [_ptr, _i64, _i64, _ptr, _ptr, _int, _i64, _i64, _i64, _ptr, _ptr, _i64, _int]
_INT4_ARGS: list[Any] = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _ptr, _ptr, _i64, _int]
_ROWS_ARGS: list[Any] = [_ptr, _i64, _int, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _ptr]


def load() -> ctypes.CDLL | None:
    """The kernel library with the quantized products' signatures set, or None where the C
    kernels are unavailable (see :func:`kvfleet.worker.runner.cpu_kernels.load`)."""
    lib = cpu_kernels.load()
    if lib is not None and lib.qgemm_int8.restype is not None:  # not yet bound
        lib.qgemm_int8.argtypes, lib.qgemm_int8.restype = _INT8_ARGS, None
        lib.qgemm_int4.argtypes, lib.qgemm_int4.restype = _INT4_ARGS, _int
        lib.quant_rows.argtypes, lib.quant_rows.restype = _ROWS_ARGS, _int
    return lib


def runs_in_c(weight: PackedWeight, dtype: torch.dtype) -> bool:
    """Whether products of ``weight`` with ``dtype`` activations can take the C kernel."""
    return weight.codes.device.type == "cpu" and dtype == torch.float32


class BoundProduct:
    """``x`` ``(T, in)`` fp32 CPU · ``weight``ᵀ (+ ``bias`` ``(out,)``) → ``(T, out)`` fp32
    through ``lib`` (from :func:`load`), the weight's kernel arguments resolved once: a
    decode step calls each projection's product once per layer, where rebuilding them
    would cost about as much as a small product. Holds ``weight`` and ``bias`` (their
    storage must stay where it is).

    Raises (on call):
        ValueError: ``x`` of the wrong width.
        MemoryError: the kernel could not allocate its scratch.
    """

    __slots__ = ("in_features", "out_features", "_fn", "_weight_args", "_held")

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._weight_args: tuple[int | None, ...]
        tail = (int(weight.half_scales), weight.in_features, weight.out_features, weight.group,
                None if bias is None else bias.data_ptr())
        if weight.bits == 8:
            self._fn = lib.qgemm_int8
            self._weight_args = (weight.codes.data_ptr(), weight.scale.data_ptr(), *tail)
        else:
            assert weight.offset is not None
            self._fn = lib.qgemm_int4
            self._weight_args = (weight.codes.data_ptr(), weight.scale.data_ptr(),
                                 weight.offset.data_ptr(), *tail)
        self._held = (weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, width = x.shape
        if width != self.in_features:
            raise ValueError(f"quantized product: x has {width} columns, the weight "
                             f"{self.in_features} inputs")
        stride = x.stride()  # one call for both: a decode step makes four products a layer
        if stride[1] != 1:
            x = x.contiguous()
            stride = x.stride()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        # int8's kernel returns nothing (None), int4's -1 when its scratch allocation failed
        if rows and self._fn(x.data_ptr(), stride[0], rows, *self._weight_args, y.data_ptr(),
                             self.out_features, torch.get_num_threads()):
            raise MemoryError("quantized product: the kernel could not allocate its group sums")
        return y


def qmatmul_c(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
              lib: ctypes.CDLL) -> torch.Tensor:
    """One product through :class:`BoundProduct` (see there: shapes, errors)."""
    return BoundProduct(weight, bias, lib)(x)


def rows(weight: PackedWeight, index: torch.Tensor) -> torch.Tensor:
    """:meth:`PackedWeight.rows` (output rows ``index`` ``(T,)`` dequantized → ``(T, in)``
    fp32), in C where the weight is on CPU and the kernels load: the same values bit for bit
    (``qrows.c``) without a dozen torch ops per lookup.

    Raises:
        IndexError: an index outside ``0 .. out_features - 1``.
    """
    lib = load() if weight.codes.is_cpu else None
    if lib is None or index.dtype != torch.int64:
        return weight.rows(index)
    index = index.contiguous()
    out = torch.empty(index.shape[0], weight.in_features, dtype=torch.float32)
    if lib.quant_rows(index.data_ptr(), index.shape[0], weight.bits, weight.codes.data_ptr(),
                      weight.scale.data_ptr(),
                      None if weight.offset is None else weight.offset.data_ptr(),
                      int(weight.half_scales), weight.in_features, weight.out_features,
                      weight.group, out.data_ptr()):
        raise IndexError(f"quantized embedding: an index outside 0..{weight.out_features - 1}")
    return out


def qmatmul_torch(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`qmatmul_c` for any device and dtype: the weight dequantized, then a matmul in
    ``x``'s dtype (no copy is kept)."""
    w = weight.dequantize().to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)
