"""A projection on a packed int8 / int4 weight: one copy serves every batch size."""

from __future__ import annotations

import torch

from kvfleet.worker.runner.quant import kernels
from kvfleet.worker.runner.quant.packed import PackedWeight
from kvfleet.worker.runner.quant.tensor import QuantTensor


class QuantLinear:
    """``x`` ``(T, in)`` → ``(T, out)`` through a :class:`PackedWeight` (a
    :class:`~kvfleet.worker.runner.models.linear.Projection`).

    fp32 activations on CPU run the C kernel (where it loads); other dtypes and devices
    dequantize the weight per call and multiply (correct, not tuned).

    Args:
        weight: the packed weight, as a :class:`QuantTensor` of shape ``[in, out]`` (the
            orientation every projection is built from).
        bias: ``(out,)`` or None.

    Raises:
        ValueError: ``weight`` is not ``[in, out]``.
    """

    __slots__ = ("weight", "bias", "in_features", "out_features", "_product")

    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None = None) -> None:
        if not weight.transposed:
            raise ValueError("QuantLinear takes its weight as [in, out] (transposed)")
        self.weight: PackedWeight = weight.packed
        self.in_features, self.out_features = self.weight.in_features, self.weight.out_features
        self.bias = bias
        lib = kernels.load() if kernels.runs_in_c(self.weight, weight.dtype) else None
        self._product = None
        if lib is not None:
            if bias is not None:
                self.bias = bias.float().contiguous()
            self._product = kernels.BoundProduct(self.weight, self.bias, lib)

    @property
    def nbytes(self) -> int:
        """Bytes of packed weight (+ bias) read per call."""
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    @property
    def held_nbytes(self) -> int:
        """Bytes held: one packed copy (:attr:`nbytes`)."""
        return self.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._product is not None and x.dtype == torch.float32 and x.is_cpu:
            return self._product(x)
        return kernels.qmatmul_torch(x, self.weight, self.bias)
