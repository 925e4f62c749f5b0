"""A decode-only step's run of one-call quantized layers as one C call (``qlayer.c``'s
``quant_decode_layers``).

With every layer on the one-call path (:mod:`.qlayer`) a batch-1 step of a small model still
pays, per layer, a Python call with its argument checks and ctypes marshalling. A
:class:`QuantDecodeStack` holds the layers' bound structs and caches in one C array, built
when bound; a step then passes only what varies per step (the step's rows, the hidden state,
the rope rows and first-key addresses) in one call that loops over the layers in C: the same
kernels in the same order as the per-layer calls, so the same results bit for bit. It is
rebuilt whenever a layer's binding or the cache changes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kvfleet.worker.runner.decode_rows import DecodeRows
from kvfleet.worker.runner.quant.qlayer import QuantDecodeLayer, load

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Entry(ctypes.Structure):
    """``qstack_t``: one layer of the run."""

    _fields_ = [("layer", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("rope", _i64),
                ("first", _i64)]


def _bind_fn(lib: ctypes.CDLL) -> Any:
    fn = lib.quant_decode_layers
    if fn.argtypes is None:  # not yet bound
        fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
        fn.restype = ctypes.c_int
    return fn


class QuantDecodeStack:
    """Layers ``calls`` (bound :class:`QuantDecodeLayer` s that :attr:`~QuantDecodeLayer.runs`)
    with their ``caches`` (``(key_cache, value_cache)`` each), rope indexes ``ropes`` and
    sliding ``windows``, as one C call per decode-only step.

    :attr:`calls` and :attr:`caches` are the objects bound: the caller compares them with the
    current ones (identity) to know whether the stack is still valid.

    Raises:
        ValueError: caches of another layout (as :class:`QuantDecodeLayer`).
    """

    __slots__ = ("calls", "caches", "windows", "_array", "_fn", "_hidden")

    def __init__(self, calls: Sequence[QuantDecodeLayer], caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 ropes: Sequence[int], windows: Sequence[int | None]) -> None:
        lib = load()
        assert lib is not None and all(c.runs for c in calls)  # as the bound layers were
        self.calls, self.caches = tuple(calls), tuple(caches)
        self.windows = tuple(dict.fromkeys(windows))  # distinct, first-use order
        self._array = (_Entry * len(calls))()
        for e, call, (k, v), rope, w in zip(self._array, calls, caches, ropes, windows, strict=True):
            call.check_caches(k, v)
            e.layer, e.k_cache, e.v_cache = call.address, k.data_ptr(), v.data_ptr()
            e.rope, e.first = rope, self.windows.index(w)
        self._hidden = calls[0].struct.hidden if calls else 0
        self._fn = _bind_fn(lib)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rows: DecodeRows, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``start..`` over ``hidden`` (left alone) of a decode-only step, as the
        model's per-layer loop would run them.

        Args:
            hidden: ``(T, hidden_size)`` fp32 CPU contiguous, ``T`` = ``rows``' rows.
            cos, sin: ``(num_ropes, T, 1, rotary_dim)`` contiguous: every rope's rows.
            rows: the step's :class:`DecodeRows`.
            start: the first layer to run.

        Returns:
            ``(hidden, out)``: the stream after the last layer is their sum.

        Raises:
            ValueError: ``hidden``, ``cos`` or ``sin`` of another shape or layout.
            MemoryError: a kernel could not allocate its scratch.
        """
        shape = hidden.shape
        if (len(shape) != 2 or shape[0] != rows.struct.rows or shape[1] != self._hidden
                or not hidden.is_contiguous() or not cos.is_contiguous() or not sin.is_contiguous()
                or cos.dim() != 4 or cos.shape != sin.shape or cos.shape[1] != shape[0]):
            raise ValueError(f"decode layers: hidden {tuple(shape)}, rope {tuple(cos.shape)} for "
                             f"{rows.struct.rows} rows")
        hidden = hidden.clone(memory_format=torch.contiguous_format)  # the input is not ours
        out = torch.empty_like(hidden)
        step = cos.stride(0) * cos.element_size()
        ropes = cos.shape[0]
        cos_at = (_ptr * ropes)(*[cos.data_ptr() + r * step for r in range(ropes)])
        sin_at = (_ptr * ropes)(*[sin.data_ptr() + r * step for r in range(ropes)])
        first = (_ptr * len(self.windows))(*[rows.first[w] for w in self.windows])
        n = len(self._array) - start
        if self._fn(ctypes.byref(self._array, start * ctypes.sizeof(_Entry)), n, rows.address,
                    hidden.data_ptr(), out.data_ptr(), cos_at, sin_at, cos.shape[-1], first):
            raise MemoryError("decode layers: a kernel could not allocate its scratch")
        return hidden, out
