"""A replica's view of a tier: its ranks' blocks keyed by their layout's shard.

The tier keys a block by (chain hash, shard). The chain hash names the model, but not how a
replica splits it: rank 1 of a tp=2 replica and rank 1 of a tp=4 one hold different KV heads
(with replicated heads even of the same shape), and a page of a replica with layer groups
holds one group's layers, not every layer, so a rank's blocks are kept as
:class:`~.store.Shard` (rank, tp, KV heads per rank, layer-group layout). :class:`LayoutTier`
turns the plain rank numbers the engine and its ranks use into those shards, so nothing above
it changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvfleet.worker.kv_tier.store import Shard, ShardStore


@dataclass(frozen=True)
class TierLayout:
    """``tp`` ranks holding ``kv_heads`` KV heads each, pages cut by layer groups ``groups``
    (:attr:`~kvfleet.allocator.layer_groups.LayerGroups.layout_key`; ``""``: one group of
    every layer). Raises ValueError for ``tp`` or ``kv_heads`` below 1."""

    tp: int
    kv_heads: int
    groups: str = ""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.kv_heads < 1:
            raise ValueError(f"a tier layout needs tp >= 1 and kv_heads >= 1, got {self}")

    def shard(self, rank: int) -> Shard:
        return Shard(rank, self.tp, self.kv_heads, self.groups)


class LayoutTier:
    """``store`` as the ranks of ``layout`` use it: rank ``r`` is ``layout.shard(r)``.
    Picklable when ``store`` is (ranks in other processes receive it in their spec); raises
    whatever ``store`` raises."""

    def __init__(self, store: ShardStore, layout: TierLayout) -> None:
        self.store, self.layout = store, layout

    @property
    def capacity_bytes(self) -> int:
        return getattr(self.store, "capacity_bytes", 0)

    @property
    def tier_id(self) -> str:
        """The index's name of the node tier underneath ("" for an in-process store)."""
        return getattr(self.store, "tier_id", "")

    def _shards(self, ranks: Sequence[int]) -> list[Shard]:
        return [self.layout.shard(r) for r in ranks]

    def put(self, rank: int, hashes: Sequence[bytes], run: np.ndarray, tag: bytes = b"") -> int:
        return self.store.put(self.layout.shard(rank), hashes, run, tag)

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> int:
        return self.store.lookup(hashes, self._shards(ranks))

    def held(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> list[bool]:
        return self.store.held(hashes, self._shards(ranks))

    def get(self, rank: int, hashes: Sequence[bytes]) -> Optional[np.ndarray]:
        return self.store.get(self.layout.shard(rank), hashes)

    def hottest(self, tag: bytes, ranks: Sequence[int], max_blocks: int) -> list[bytes]:
        return self.store.hottest(tag, self._shards(ranks), max_blocks)

    def stats(self):
        """The store's counters (a Ray call on a node tier)."""
        return self.store.stats()  # type: ignore[attr-defined]

    def on_node(self, node_id: str) -> "LayoutTier":
        """The same deployment's tier on node ``node_id``, seen through this layout.
        Raises ValueError (Ray's) when that node has none."""
        return LayoutTier(self.store.on_node(node_id), self.layout)  # type: ignore[attr-defined]
