"""Tensor parallelism applied to a built model: its row-parallel projections sum their output.

A model is built from one rank's local config and sliced weights (:mod:`.layout`,
:mod:`.shard_weights`), so its column-parallel projections (Q/K/V, gate/up) already compute
this rank's output columns as plain :class:`~kvfleet.worker.runner.models.linear.Linear`
projections. Its row-parallel ones (O, down) compute a partial sum over this rank's inputs;
:func:`parallelize` wraps each in a :class:`RowParallelLinear` that all-reduces it, so the model
code stays the single-device model.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvfleet.worker.runner.models import PROJECTIONS, CausalLM
from kvfleet.worker.runner.models.linear import Projection
from kvfleet.worker.runner.models.moe import SparseMoE
from kvfleet.worker.runner.tp.layout import ROW, SPLITS, ShardLayout

Reduce = Callable[[torch.Tensor], torch.Tensor]


class RowParallelLinear:
    """A row-parallel projection: ``x`` ``(T, in / tp)`` → ``(T, out)``, the sum over every
    rank of their partial products.

    Args:
        local: this rank's share of the projection (with any LoRA update already in it, so
            the update's partial sums join the same all-reduce).
        reduce: sums a tensor over the ranks, in place, and returns it.
    """

    __slots__ = ("local", "reduce")

    def __init__(self, local: Projection, reduce: Reduce) -> None:
        self.local, self.reduce = local, reduce

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    @property
    def held_nbytes(self) -> int:
        return self.local.held_nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.local(x))


def row_parallel(name: str) -> bool:
    """Whether the model projection ``name`` (a key of ``PROJECTIONS``) splits its input."""
    return all(SPLITS[m].axis == ROW for m in PROJECTIONS[name])


def parallelize(model: CausalLM, layout: ShardLayout, reduce: Reduce) -> None:
    """Wrap every row-parallel projection of ``model`` (built from ``layout``'s local config)
    in a :class:`RowParallelLinear` summing over ``layout.tp`` ranks with ``reduce``, and give a
sparse MLP block (:class:`~kvfleet.worker.runner.models.moe.SparseMoE`) ``reduce`` for its
one all-reduce of the experts' partial sums. At tp=1
    every product is already whole: nothing is wrapped. Apply LoRA first
    (:func:`kvfleet.worker.runner.lora.layer.apply_lora`)."""
    if layout.tp == 1:
        return
    for layer in model.layers:
        for name, holder in layer.projection_holders().items():
            if row_parallel(name):
                setattr(holder, name, RowParallelLinear(getattr(holder, name), reduce))
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SparseMoE):  # its experts' partial outputs, summed once
            mlp.reduce = reduce
