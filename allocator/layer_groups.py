"""KV layer groups: layers that share one block table per sequence (docs/design.md §3,
"Layer groups").

Layers are bucketed by attention kind (full, or sliding with window ``w``); each bucket is cut
into groups of ``g`` layers, ``g`` the greatest common divisor of the bucket sizes, so every
group has the same number of layers and one page (``block_size`` tokens of one group's ``g``
layers, K and V) has the same bytes in every group. One pool of such pages then serves every
group. Layer ``l`` lives at slot ``slot_of(l)`` of a page of group ``group_of(l)``.

Full attention everywhere is the one-group case: one group of every layer, pages as big as
the blocks of a model without groups, so nothing changes for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LayerGroups:
    """Which layers share a block table, and each group's window.

    ``layers[g]``: the layer indices of group ``g`` in slot order (every group equally many);
    ``windows[g]``: the group's sliding window in tokens, or None (full attention: it keeps
    every block). Groups are ordered full first, then by window, then by first layer.
    """

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if not self.layers or len(self.layers) != len(self.windows):
            raise ValueError("layer groups: one window per group, at least one group")
        sizes = {len(g) for g in self.layers}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"layer groups: every group needs the same number of layers, got {sizes}")
        flat = sorted(i for g in self.layers for i in g)
        if flat != list(range(len(flat))):
            raise ValueError("layer groups: each layer must be in exactly one group")
        for w in self.windows:
            if w is not None and w < 1:
                raise ValueError(f"layer groups: a window must be >= 1 token, got {w}")
        group, slot = [0] * len(flat), [0] * len(flat)
        for g, members in enumerate(self.layers):
            for s, layer in enumerate(members):
                group[layer], slot[layer] = g, s
        object.__setattr__(self, "_group", tuple(group))
        object.__setattr__(self, "_slot", tuple(slot))

    @classmethod
    def single(cls, num_layers: int) -> "LayerGroups":
        """One group of every layer keeping every block (the layout without groups)."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        return cls((tuple(range(num_layers)),), (None,))

    @classmethod
    def from_windows(cls, windows: Sequence[int | None]) -> "LayerGroups":
        """Groups for layers whose windows are ``windows[l]`` (None: full attention).

        Raises:
            ValueError: no layers, or a window below 1.
        """
        if not windows:
            raise ValueError("layer groups: no layers")
        buckets: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            buckets.setdefault(w, []).append(layer)
        size = math.gcd(*(len(b) for b in buckets.values()))
        order = sorted(buckets, key=lambda w: (w is not None, w or 0))
        layers, group_windows = [], []
        for w in order:
            members = buckets[w]
            for start in range(0, len(members), size):
                layers.append(tuple(members[start:start + size]))
                group_windows.append(w)
        return cls(tuple(layers), tuple(group_windows))

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self._group)  # type: ignore[attr-defined]

    @property
    def layers_per_group(self) -> int:
        """Layers in each group: the slots of one page."""
        return len(self.layers[0])

    @property
    def windowed(self) -> bool:
        """Whether some group drops blocks outside its window."""
        return any(w is not None for w in self.windows)

    @property
    def layout_key(self) -> str:
        """The layout as a stable string: ``""`` for one full group (the layout without
        groups), else each group's window (``full`` or ``w<tokens>``) and layers, e.g.
        ``"full:0,3|w7:1,2"`` for a full group of layers 0 and 3 beside a sliding one. KV
        written under one layout is never valid under another (the host tier's shards and
        the step-cost cache key carry it)."""
        if self.num_groups == 1 and not self.windowed:
            return ""
        return "|".join(f"{'full' if w is None else f'w{w}'}:{','.join(map(str, layers))}"
                        for layers, w in zip(self.layers, self.windows, strict=True))

    def group_of(self, layer: int) -> int:
        return self._group[layer]  # type: ignore[attr-defined]

    def slot_of(self, layer: int) -> int:
        return self._slot[layer]  # type: ignore[attr-defined]
