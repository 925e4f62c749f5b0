"""Adapter slots of one rank's model, and the per-step batch view that applies them.

A rank holds ``max_loras`` slots (1..max_loras; slot 0 is the base model: no update). Each
step, every token carries its chunk's slot; :class:`LoraBatch` groups the step's token rows by
slot once (the segment/gather formulation of Punica's SGMV and S-LoRA): per projection it
runs one ``(x[rows] @ A) @ B`` per adapter present in the batch, whatever the number of
requests, and adds it into the base projection's output. Base weights are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, group) → (A, B)


class LoraSlots:
    """``max_loras`` slots of fused adapter weights (see :func:`.adapter.read_adapter`).

    Installing into a slot no running request uses is safe while a forward runs on another
    thread: a forward reads only the slots its plan names.
    """

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._weights: list[Weights | None] = [None] * (max_loras + 1)

    def install(self, slot: int, weights: Weights) -> None:
        """Put an adapter's weights in ``slot`` (1..max_loras), replacing what was there."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"adapter slot must lie in [1, {self.max_loras}], got {slot}")
        self._weights[slot] = weights

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its tensors are freed once no step holds them)."""
        if 1 <= slot <= self.max_loras:
            self._weights[slot] = None

    def get(self, slot: int) -> Weights | None:
        return self._weights[slot] if 0 < slot <= self.max_loras else None

    def is_loaded(self, slot: int) -> bool:
        return slot == 0 or self.get(slot) is not None

    def nbytes(self) -> int:
        """Bytes of every installed adapter's A and B."""
        return sum(a.nbytes + b.nbytes for w in self._weights if w for a, b in w.values())


@dataclass(frozen=True)
class LoraBatch:
    """One step's token rows grouped by adapter: ``segments`` holds, per adapter present,
    its weights and its rows of the step's ``(T, ·)`` activations (a slice when contiguous,
    else a LongTensor of row indices)."""

    segments: tuple[tuple[Weights, slice | torch.Tensor], ...]

    @classmethod
    def build(cls, slots: LoraSlots, chunk_slots: Sequence[int], chunk_lens: Sequence[int],
              device: torch.device) -> "LoraBatch | None":
        """Group the rows of chunks (in plan order, ``chunk_lens[i]`` tokens each) by slot;
        None when every chunk runs the base model.

        Raises:
            ValueError: a chunk names a slot that holds no adapter (a scheduler bug).
        """
        ranges: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(chunk_slots, chunk_lens, strict=True):
            if slot:
                if not slots.is_loaded(slot):
                    raise ValueError(f"adapter slot {slot} is empty")
                spans = ranges.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if not ranges:
            return None
        segments = []
        for slot, spans in ranges.items():
            if len(spans) == 1:
                rows: slice | torch.Tensor = slice(*spans[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
            weights = slots.get(slot)
            assert weights is not None  # checked loaded above
            segments.append((weights, rows))
        return cls(tuple(segments))

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] @ A) @ B`` for every adapter that targets ``(layer, group)``;
        ``x`` ``(T, in)`` is the projection's input, ``y`` ``(T, out)`` its output (in place)."""
        for weights, rows in self.segments:
            ab = weights.get((layer, group))
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice):  # two ops: shrink, then expand-and-add in place
                y[rows].addmm_(x[rows] @ a, b)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a) @ b)
