"""LoRA on the fallback's linears, found by module name.

Adapters are checked and read exactly as for a native family (:mod:`kvfleet.worker.runner.lora`):
PEFT names (``q_proj`` … ``down_proj``), each group of :data:`~kvfleet.worker.runner.models.PROJECTIONS`
read as one stacked ``A`` and block-diagonal ``B`` for this rank. Here each member linear of a
group (``layers.{i}.….q_proj``) gets a forward hook that adds, for the step's rows of every
adapter, ``x @ A @ B[:, cols]`` with ``cols`` that member's output columns in the group (the
other members' rank rows of ``B`` are zero there). The hook runs before the tensor-parallel
hooks (:mod:`.tp`): a row-parallel update joins the partial sum before the all-reduce, a
column-parallel one this rank's columns before any gather.
"""

from __future__ import annotations

import torch

from kvfleet.worker.runner.lora.layer import AdapterMapping
from kvfleet.worker.runner.model_config import UnsupportedModel
from kvfleet.worker.runner.models import PROJECTIONS


class FallbackAdapters(AdapterMapping):
    """The step's adapter rows (see :class:`AdapterMapping`) and the ``(layer, group)`` pairs
    whose every member linear was found, which alone an adapter may target."""

    __slots__ = ("targets",)

    def __init__(self) -> None:
        super().__init__()
        self.targets: set[tuple[int, str]] = set()

    def check(self, weights: dict[tuple[int, str], object]) -> None:
        """Refuse adapter weights for a group the model's linears do not hold.

        Raises:
            UnsupportedModel: naming the layer and the group.
        """
        missing = sorted(set(weights) - self.targets)
        if missing:
            layer, group = missing[0]
            raise UnsupportedModel(f"layer {layer} has no linears {', '.join(PROJECTIONS[group])} "
                                   f"for this adapter's {group} update (--model-impl transformers)")


def _hook(mapping: AdapterMapping, layer: int, group: str, col: int):
    def add_updates(module, args, out):
        batch = mapping.batch
        if batch is None:
            return None
        x = args[0].reshape(-1, args[0].shape[-1])
        y = out.view(-1, out.shape[-1])
        for weights, rows in batch.segments:
            ab = weights.get((layer, group))
            if ab is None:
                continue
            a, b = ab[0], ab[1][:, col: col + y.shape[1]]
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ a, b)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a) @ b)
        return None
    return add_updates


def apply_fallback_lora(model, max_loras: int) -> FallbackAdapters:
    """Hook every linear of ``model.layers`` named like a member of a projection group (with
    ``max_loras`` 0 nothing is hooked); returns the mapping the runner sets each step."""
    mapping = FallbackAdapters()
    if max_loras == 0:
        return mapping
    for i, layer in enumerate(model.layers):
        linears = {name.rsplit(".", 1)[-1]: mod for name, mod in layer.named_modules()
                   if isinstance(mod, torch.nn.Linear)}
        for group, members in PROJECTIONS.items():
            if not all(m in linears for m in members):
                continue
            col = 0
            for m in members:
                linears[m].register_forward_hook(_hook(mapping, i, group, col), prepend=True)
                col += linears[m].weight.shape[0]
            mapping.targets.add((i, group))
    return mapping
