"""A quantized weight that travels a model's load path in place of its float tensor.

A model family reads HF-named float tensors, fuses some along their outputs (``torch.cat``),
transposes its projections to ``[in, out]``, moves them to the device, assigns them as
parameters and packs each projection (:func:`kvfleet.worker.runner.models.linear.projection`).
A :class:`QuantTensor` stands in for the float weight all the way: it supports exactly those
steps on its :class:`~.packed.PackedWeight`, so the model code holds no quantization logic;
packing then turns it into a :class:`~.linear.QuantLinear`, and an embedding lookup
(``F.embedding``) dequantizes the rows it reads. A tied LM head and its embedding share one
packed weight. Anything else done to it raises :class:`QuantizedOpError` naming the op: a
family that needs more from its weights cannot serve quantized (refused at load).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvfleet.worker.runner.quant import kernels
from kvfleet.worker.runner.quant.packed import PackedWeight, concat_outputs


class QuantizedOpError(TypeError):
    """An operation a quantized weight does not support (the message names it)."""


def _no_op(t: QuantTensor, *args: Any, **kwargs: Any) -> QuantTensor:
    return t


def _to(t: QuantTensor, *args: Any, **kwargs: Any) -> QuantTensor:
    device, dtype = t.device, t.dtype
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.device, str)):
            device = torch.device(a)
    return QuantTensor(t.packed.to(device), dtype, t.transposed)


def _transpose(t: QuantTensor, *args: Any, **kwargs: Any) -> QuantTensor:
    return QuantTensor(t.packed, t.dtype, not t.transposed)


def _cat(tensors: Any, dim: int = 0, **kwargs: Any) -> QuantTensor:
    parts = list(tensors)
    if (dim != 0 or not all(isinstance(p, QuantTensor) and not p.transposed for p in parts)
            or kwargs.get("out") is not None):
        raise QuantizedOpError("quantized weights concatenate only along their outputs (dim 0 "
                               "of [out, in])")
    return QuantTensor(concat_outputs([p.packed for p in parts]), parts[0].dtype)


def _embedding(input: torch.Tensor, weight: QuantTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if weight.transposed or any(a not in (None, False, 2.0) for a in (*args, *kwargs.values())):
        raise QuantizedOpError("a quantized embedding table supports plain lookups only")
    return kernels.rows(weight.packed, input.flatten()).view(*input.shape, -1).to(weight.dtype)


_OPS: dict[Callable, Callable] = {
    torch.Tensor.detach: _no_op, torch.Tensor.requires_grad_: _no_op,
    torch.Tensor.contiguous: _no_op, torch.Tensor.to: _to,
    torch.Tensor.t: _transpose, torch.t: _transpose,
    torch.cat: _cat, F.embedding: _embedding,
}
_READS = {"__get__", "dim", "size"}  # attribute reads (shape, dtype, device, …) and methods


class QuantTensor(torch.Tensor):
    """A stand-in float tensor of shape ``[out, in]`` (or ``[in, out]`` once transposed)
    holding ``packed``; ``dtype`` is the model's activation dtype. See the module docstring."""

    packed: PackedWeight
    transposed: bool

    @staticmethod
    def __new__(cls, packed: PackedWeight, dtype: torch.dtype = torch.float32,
                transposed: bool = False) -> QuantTensor:
        shape = (packed.out_features, packed.in_features)
        t = torch.Tensor._make_wrapper_subclass(cls, shape[::-1] if transposed else shape,
                                                dtype=dtype, device=packed.codes.device)
        t.packed, t.transposed = packed, transposed
        return t

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        """Bytes of the packed weight (codes, scales, offsets)."""
        return self.packed.nbytes

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        p = self.packed
        return (f"QuantTensor(int{p.bits}, group {p.group}, shape {tuple(self.shape)}, "
                f"{'transposed, ' if self.transposed else ''}{p.nbytes} B)")

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = _OPS.get(func)
        if op is not None:
            return op(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise QuantizedOpError(f"quantized weights do not support {name} (serve this model "
                               f"with --quantization none)")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:
        raise QuantizedOpError(f"quantized weights do not support {func}")
