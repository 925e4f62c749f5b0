"""The host KV tier's bookkeeping: a byte-budgeted LRU of KV blocks keyed by chain hash and rank.

A key is ``(chain hash, rank)``: the chain hash (:mod:`kvfleet.allocator.hashing`) already
carries the model identity, adapter revision, tenant and salt, so a block can only ever be
found again by a request whose own chain yields the same hash; the rank keeps each
tensor-parallel rank's KV-head shard apart. Blocks move as *runs* (one array per call, one
object in Ray's object store), never one object per block: see docs/kv_tier.md.

One store serves every replica of a node (:mod:`.node_tier` wraps it in a Ray actor); this
class is also the in-process implementation the tests and benchmarks use directly.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

Key = tuple[bytes, int]  # (chain hash, rank)
# Told rank 0's residency changes in order, under the store's lock: (chain hash, held now).
ResidencyListener = Callable[[list[tuple[bytes, bool]]], None]


class TierStore(Protocol):
    """What a rank calls: :class:`HostTierStore` in process, or
    :class:`~.node_tier.RayTier` on the node's actor (may raise on a dead actor)."""

    def put(self, rank: int, hashes: Sequence[bytes], run: np.ndarray,
            tag: bytes = b"") -> int: ...

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> int: ...

    def get(self, rank: int, hashes: Sequence[bytes]) -> Optional[np.ndarray]: ...

    def hottest(self, tag: bytes, ranks: Sequence[int], max_blocks: int) -> list[bytes]: ...


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

    def put(self, rank: int, hashes: Sequence[bytes], run: np.ndarray, tag: bytes = b"") -> int:
        """Store ``run[i]`` under ``(hashes[i], rank)`` (a run of blocks, block-major: shape
        ``(len(hashes), ...)``), each as its own copy (``run`` may be a read-only view into
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
                while self._bytes + block.nbytes > self.capacity_bytes:
                    (old_hash, old_rank), old = self._blocks.popitem(last=False)
                    self._tags.pop((old_hash, old_rank), None)
                    self._bytes -= old.nbytes
                    self._evicted += 1
                    if old_rank == 0:
                        changes.append((old_hash, False))
                self._blocks[key] = np.array(block, copy=True)
                self._tags[key] = tag
                self._bytes += block.nbytes
                stored += 1
                if rank == 0:
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
            return [h for h, r in self._blocks if r == 0]

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> int:
        """How many leading ``hashes`` are held for every rank in ``ranks`` (marked recently
        used, so a restore that follows finds them)."""
        with self._lock:
            for i, h in enumerate(hashes):
                keys = [(bytes(h), r) for r in ranks]
                if not all(k in self._blocks for k in keys):
                    return i
                for k in keys:
                    self._blocks.move_to_end(k)
            return len(hashes)

    def get(self, rank: int, hashes: Sequence[bytes]) -> np.ndarray | None:
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

    def hottest(self, tag: bytes, ranks: Sequence[int], max_blocks: int) -> list[bytes]:
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

    def clear(self) -> None:
        """Drop every block (counters are kept)."""
        with self._lock:
            self._tell([(h, False) for h, r in self._blocks if r == 0])
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
