"""Dense projections ``y = x @ W (+ b)`` with weights pre-packed for the CPU's GEMM library.

Through MKL, every ``mm`` call re-packs the whole weight into its blocked layout before
multiplying; for the few rows of a decode step that re-packing costs as much as the product
itself. oneDNN can take a weight packed once at load time, which makes decode-sized products
markedly faster and prefill chunks somewhat faster. So on CPU in fp32
every projection runs on a packed weight (packed for a batch of ``PACK_BATCH_HINT`` rows, the
best single choice over 1-512 rows); elsewhere, or where this torch build lacks the op, a plain
``[in, out]`` matmul. The packed tensor is opaque: only :class:`Linear` may read it.

:class:`Projection` is what a model calls; the tensor-parallel and LoRA layers
(:mod:`kvfleet.worker.runner.tp.linear`, :mod:`kvfleet.worker.runner.lora.layer`) wrap a
:class:`Linear` and are projections too. A model packs each loaded weight with
:func:`projection`, which gives a quantized weight (:mod:`kvfleet.worker.runner.quant`) its
:class:`~kvfleet.worker.runner.quant.linear.QuantLinear` instead.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.quant.linear import QuantLinear
from kvfleet.worker.runner.quant.tensor import QuantTensor

PACK_BATCH_HINT = 16
# Most rows a product takes through the C few-row kernel (with a copy to run on): decode and
# verify steps, and the steps of a small prefill chunk beside decode rows. The kernel streams a
# weight once and runs every tile of rows over a panel while it is in cache, at the FMA rate
# once a tile is full; oneDNN's packed GEMM only catches up past this many rows (one measured
# crossover for every projection shape of the default model: docs/speculative.md).
FEW_ROWS = 64


def pack_weight(weight_in_out: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of an ``[in, out]`` weight, or None where packing does not apply
    (not fp32, not CPU, op missing, or a probe product that disagrees with ``mm``)."""
    if weight_in_out.dtype != torch.float32 or weight_in_out.device.type != "cpu":
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight_in_out.t().contiguous(),
                                                         PACK_BATCH_HINT)
        probe = torch.linspace(-1, 1, 3 * weight_in_out.shape[0]).view(3, -1)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    want = probe @ weight_in_out
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return None
    return packed


class Projection(Protocol):
    """``x`` ``(T, in)`` → ``(T, out)``, and the bytes of weight behind it."""

    @property
    def nbytes(self) -> int:
        """Bytes of weight (+ bias) one call reads."""
        ...

    @property
    def held_nbytes(self) -> int:
        """Bytes of weight held, every copy counted."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear:
    """One projection: ``x`` ``(T, in)`` → ``(T, out)``.

    Args:
        weight: ``[in, out]`` (float, any device); replaced by its packed copy where available.
        bias: ``(out,)`` or None.
        one_row_copy: also keep a panel copy (:func:`~kvfleet.worker.runner.cpu_kernels.pack_panels`)
            for products of up to :data:`FEW_ROWS` rows through the C few-row kernel of
            :mod:`kvfleet.worker.runner.cpu_kernels` (where it loads): a decode step of a few
            rows, or a verify chunk, then streams the weight once at close to the read
            bandwidth, and a step with a small prefill chunk runs at the FMA rate without the
            GEMM's fixed cost, at the cost of holding the weight twice.
    """

    __slots__ = ("weight", "bias", "packed", "in_features", "out_features", "panels", "_lib")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 one_row_copy: bool = False) -> None:
        self.in_features, self.out_features = weight.shape
        packed = pack_weight(weight)
        self.packed = packed is not None
        self.panels = None
        self._lib = cpu_kernels.load() if one_row_copy and self.packed else None
        if self._lib is not None:  # chosen once: a later KVFLEET_C_KERNELS change does not apply
            self.panels = cpu_kernels.pack_panels(weight, self._lib)
        self.weight = packed if packed is not None else weight
        self.bias = bias

    @property
    def nbytes(self) -> int:
        """Bytes of weight + bias read per call."""
        n = self.in_features * self.out_features * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    @property
    def held_nbytes(self) -> int:
        """Bytes held: :attr:`nbytes` plus the few-row panel copy, if any."""
        return self.nbytes + (self.panels.nbytes if self.panels is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and 0 < x.shape[0] <= FEW_ROWS:
            return cpu_kernels.gemv(x, self.panels, self.bias, self.out_features, self._lib)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)


def projection(weight: torch.Tensor, bias: torch.Tensor | None = None,
               one_row_copy: bool = False) -> Projection:
    """The projection a model packs a loaded ``[in, out]`` weight into: a
    :class:`~kvfleet.worker.runner.quant.linear.QuantLinear` for a quantized weight (one packed
    copy; ``one_row_copy`` does not apply), else a :class:`Linear`."""
    if isinstance(weight, QuantTensor):
        return QuantLinear(weight, bias)
    return Linear(weight, bias, one_row_copy)


class NoLinear:
    """Stands in for a projection a model was built without (the LM head of a tensor-parallel
    rank that computes no logits): holds no weight; ``x`` ``(T, in)`` → ``(0, out_features)``."""

    __slots__ = ("out_features",)
    nbytes = held_nbytes = 0

    def __init__(self, out_features: int) -> None:
        self.out_features = out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(0, self.out_features)
