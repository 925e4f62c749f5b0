"""The host KV tier's bookkeeping: a byte-budgeted LRU of KV blocks keyed by chain hash and rank.

A key is ``(chain hash, shard)``: the chain hash (:mod:`kvfleet.allocator.hashing`) already
carries the model identity, adapter revision, tenant and salt, so a block can only ever be
found again by a request whose own chain yields the same hash; the shard keeps each
tensor-parallel rank's KV heads apart. A replica's ranks name their shard as a :class:`Shard`
(rank, tp, KV heads per rank: :mod:`.tier_layout`), since the same rank of another layout
holds other heads — with replicated KV heads, of the same shape; a plain ``int`` rank (the
in-process tests) is a shard too. Blocks move as *runs* (one array per call, one
object in Ray's object store), never one object per block: see docs/kv_tier.md.

One store serves every replica of a node (:mod:`.node_tier` wraps it in a Ray actor); this
class is also the in-process implementation the tests and benchmarks use directly.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np

from kvfleet.allocator.kv_cache_manager import is_group_key


class Shard(NamedTuple):
    """Rank ``rank`` of a ``tp``-way layout whose ranks hold ``kv_heads`` KV heads each, its
    pages cut by layer groups ``groups`` (:attr:`~kvfleet.allocator.layer_groups.LayerGroups.
    layout_key`; ``""``: one page holds every layer)."""

    rank: int
    tp: int
    kv_heads: int
    groups: str = ""


ShardKey = Union[int, Shard]
Key = tuple[bytes, ShardKey]  # (chain hash, shard)


def shard_rank(shard: ShardKey) -> int:
    """The rank of ``shard`` (rank 0's blocks are what the index is told about)."""
    return shard.rank if isinstance(shard, Shard) else shard


def shown(key: Key) -> bool:
    """Whether the index is told about ``key``: rank 0's blocks under a chain hash (a layer
    group's own page key, :func:`~kvfleet.allocator.kv_cache_manager.is_group_key`, stays
    local: the router keys the prefix, not the layout)."""
    return shard_rank(key[1]) == 0 and not is_group_key(key[0])
# Told rank 0's residency changes in order, under the store's lock: (chain hash, held now).
ResidencyListener = Callable[[list[tuple[bytes, bool]]], None]


class TierStore(Protocol):
    """What a rank calls: :class:`HostTierStore` in process, or
    :class:`~.node_tier.RayTier` on the node's actor (may raise on a dead actor)."""

    def put(self, rank: int, hashes: Sequence[bytes], run: np.ndarray,
            tag: bytes = b"") -> int: ...

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> int: ...

    def held(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> list[bool]: ...

    def get(self, rank: int, hashes: Sequence[bytes]) -> Optional[np.ndarray]: ...

    def hottest(self, tag: bytes, ranks: Sequence[int], max_blocks: int) -> list[bytes]: ...


class ShardStore(Protocol):
    """A store keyed by :data:`ShardKey` (:class:`HostTierStore`, a node tier): what a
    :class:`~.tier_layout.LayoutTier` maps a replica's ranks onto."""

    def put(self, rank: ShardKey, hashes: Sequence[bytes], run: np.ndarray,
            tag: bytes = b"") -> int: ...

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[ShardKey]) -> int: ...

    def held(self, hashes: Sequence[bytes], ranks: Sequence[ShardKey]) -> list[bool]: ...

    def get(self, rank: ShardKey, hashes: Sequence[bytes]) -> Optional[np.ndarray]: ...

    def hottest(self, tag: bytes, ranks: Sequence[ShardKey], max_blocks: int) -> list[bytes]: ...


@dataclass(frozen=True)
class TierStats:
    """Counters of one store (bytes are integers)."""

    capacity_bytes: int
    bytes_used: int
    blocks: int
    stored: int    # blocks written (write-backs accepted)
    evicted: int   # blocks dropped to stay within capacity
    restored: int  # blocks served by get


class HostTierStore:
    """LRU over ``capacity_bytes`` of block arrays. Thread-safe.

    ``listener``, when given, is told every change of rank 0's residency (blocks stored,
    blocks evicted or cleared) under the store's lock, so it sees them in the order they
    happened (:mod:`.tier_publisher` puts them in the prefix index); it must be quick.

    Raises:
        ValueError: a capacity below 0.
    """

    def __init__(self, capacity_bytes: int, listener: Optional[ResidencyListener] = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.listener = listener
        self._blocks: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._tags: dict[Key, bytes] = {}  # who wrote each block (the model identity)
        self._bytes = 0
        self._lock = threading.Lock()
        self._stored = self._evicted = self._restored = 0

    def put(self, rank: ShardKey, hashes: Sequence[bytes], run: np.ndarray,
            tag: bytes = b"") -> int:
        """Store ``run[i]`` under ``(hashes[i], rank)`` (``rank``: the shard; a run of blocks,
        block-major: shape ``(len(hashes), ...)``), each as its own copy (``run`` may be a read-only view into
        the object store), evicting least recently used blocks to fit. A block larger than
        the whole capacity is not stored. ``tag`` (the writer's model identity digest) is
        kept with each new block for :meth:`hottest`; it plays no part in lookups (the chain
        hash already carries the identity). Returns the blocks stored.

        Raises:
            ValueError: ``run``'s first dimension differs from ``len(hashes)``.
        """
        if run.shape[0] != len(hashes):
            raise ValueError(f"run holds {run.shape[0]} blocks for {len(hashes)} hashes")
        stored = 0
        with self._lock:
            changes: list[tuple[bytes, bool]] = []
            for h, block in zip(hashes, run, strict=True):
                key = (bytes(h), rank)
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                if block.nbytes > self.capacity_bytes:
                    continue
                self._evict_to(self.capacity_bytes - block.nbytes, changes)
                self._blocks[key] = np.array(block, copy=True)
                self._tags[key] = tag
                self._bytes += block.nbytes
                stored += 1
                if shown(key):
                    changes.append((key[0], True))
            self._stored += stored
            self._tell(changes)
        return stored

    def _tell(self, changes: list[tuple[bytes, bool]]) -> None:
        if self.listener is not None and changes:
            self.listener(changes)

    def held_hashes(self) -> list[bytes]:
        """Chain hashes of every block whose rank-0 shard is held (what the index shows)."""
        with self._lock:
            return [h for h, r in self._blocks if shown((h, r))]

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[ShardKey]) -> int:
        """How many leading ``hashes`` are held for every rank in ``ranks``. Changes no
        recency: a sequence looked up may never be admitted (only :meth:`get`, a restore,
        and :meth:`put` make blocks recently used)."""
        with self._lock:
            for i, h in enumerate(hashes):
                if not all((bytes(h), r) in self._blocks for r in ranks):
                    return i
            return len(hashes)

    def held(self, hashes: Sequence[bytes], ranks: Sequence[ShardKey]) -> list[bool]:
        """For each of ``hashes``, whether it is held for every rank in ``ranks`` (what
        admission needs for layer groups, whose hits are not one leading run). Changes no
        recency."""
        with self._lock:
            return [all((bytes(h), r) in self._blocks for r in ranks) for h in hashes]

    def get(self, rank: ShardKey, hashes: Sequence[bytes]) -> np.ndarray | None:
        """The run ``(len(hashes), ...)`` of ``rank``'s blocks under ``hashes``, stacked into
        one array; None when any of them is missing (evicted since the lookup)."""
        with self._lock:
            keys = [(bytes(h), rank) for h in hashes]
            if not keys or not all(k in self._blocks for k in keys):
                return None
            for k in keys:
                self._blocks.move_to_end(k)
            self._restored += len(keys)
            return np.stack([self._blocks[k] for k in keys])

    def hottest(self, tag: bytes, ranks: Sequence[ShardKey], max_blocks: int) -> list[bytes]:
        """Chain hashes of up to ``max_blocks`` blocks written with ``tag`` and held for every
        rank in ``ranks``, most recently used first (what a new replica of that identity
        pre-warms its pool with). Changes no recency."""
        out: list[bytes] = []
        if not ranks or max_blocks <= 0:
            return out
        with self._lock:
            for h, r in reversed(self._blocks):
                if r != ranks[0] or self._tags.get((h, r)) != tag:
                    continue
                if all((h, other) in self._blocks for other in ranks[1:]):
                    out.append(h)
                    if len(out) >= max_blocks:
                        break
        return out

    def resize(self, capacity_bytes: int) -> None:
        """Hold at most ``capacity_bytes`` from now on, evicting least recently used blocks
        to fit. Raises ValueError for a capacity below 0."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        with self._lock:
            self.capacity_bytes = capacity_bytes
            changes: list[tuple[bytes, bool]] = []
            self._evict_to(capacity_bytes, changes)
            self._tell(changes)

    def _evict_to(self, limit: int, changes: list[tuple[bytes, bool]]) -> None:
        """Drop least recently used blocks until at most ``limit`` bytes are held; rank 0's
        go to ``changes``. Call with ``_lock`` held."""
        while self._bytes > limit:
            (h, r), old = self._blocks.popitem(last=False)
            self._tags.pop((h, r), None)
            self._bytes -= old.nbytes
            self._evicted += 1
            if shown((h, r)):
                changes.append((h, False))

    def clear(self) -> None:
        """Drop every block (counters are kept)."""
        with self._lock:
            self._tell([(h, False) for h, r in self._blocks if shown((h, r))])
            self._blocks.clear()
            self._tags.clear()
            self._bytes = 0

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.capacity_bytes, self._bytes, len(self._blocks), self._stored,
                             self._evicted, self._restored)

    def check_invariants(self) -> None:
        """Bytes used equal the sum of the blocks held and stay within capacity."""
        with self._lock:
            assert self._bytes == sum(b.nbytes for b in self._blocks.values()), "bytes drifted"
            assert self._bytes <= self.capacity_bytes, "over capacity"
            assert self._tags.keys() == self._blocks.keys(), "tags drifted"
