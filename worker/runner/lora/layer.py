"""LoRA applied to a built model: each targeted projection adds its adapters' updates.

:func:`apply_lora` wraps every projection of every decoder layer in a :class:`LoraLinear`;
all of them read one :class:`AdapterMapping`, which the runner sets once per step to that
step's :class:`~.slots.LoraBatch` (which token rows run which adapter). A step with no adapter
rows runs each base projection alone. The model code stays the base model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvfleet.worker.runner.lora.slots import LoraBatch
from kvfleet.worker.runner.models import CausalLM
from kvfleet.worker.runner.models.linear import Projection


class AdapterMapping:
    """The current step's adapter rows, shared by every :class:`LoraLinear` of one model;
    ``batch`` is None outside a step and in a step that runs the base model only."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None

    @contextmanager
    def step(self, batch: LoraBatch | None) -> Iterator[None]:
        """Set ``batch`` for the duration of one forward (or one stretch of its layers), then
        put back what was set before: None outside a step (it holds adapter tensors a later
        :meth:`~.slots.LoraSlots.clear` means to free), the outer step's batch when a nested
        step runs inside one (layer-level yield)."""
        outer, self.batch = self.batch, batch
        try:
            yield
        finally:
            self.batch = outer


class LoraLinear:
    """A projection ``x`` ``(T, in)`` → ``(T, out)`` plus, for the rows of each adapter in the
    step's mapping that targets ``(layer, group)``, that adapter's low-rank update."""

    __slots__ = ("base", "layer", "group", "mapping")

    def __init__(self, base: Projection, layer: int, group: str, mapping: AdapterMapping) -> None:
        self.base, self.layer, self.group, self.mapping = base, layer, group, mapping

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    @property
    def held_nbytes(self) -> int:
        return self.base.held_nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.mapping.batch
        if batch is not None:
            batch.apply(self.layer, self.group, x, y)
        return y


def apply_lora(model: CausalLM, max_loras: int) -> AdapterMapping:
    """Wrap each decoder layer's projections (``PROJECTIONS``, the fused groups adapters are
    read into, wherever the layer holds them), each in a :class:`LoraLinear` reading the
    returned mapping. With ``max_loras`` 0
    nothing is wrapped. Apply before :func:`kvfleet.worker.runner.tp.linear.parallelize`, so
    an update joins its projection's partial sum before the all-reduce."""
    mapping = AdapterMapping()
    if max_loras > 0:
        for i, layer in enumerate(model.layers):
            for name, holder in layer.projection_holders().items():
                setattr(holder, name, LoraLinear(getattr(holder, name), i, name, mapping))
    return mapping
