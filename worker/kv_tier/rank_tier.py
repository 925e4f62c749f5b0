"""One rank's side of the host tier: write back evicted blocks, restore hit blocks.

Write-back (:meth:`RankTier.save`) runs on the step path but only copies: the evicted blocks'
K/V are gathered into one fresh tensor (one memory copy; the pool may overwrite the blocks as
soon as this returns) and handed to a background thread, which puts the run into the tier.
On CUDA the gather and the device → host copy run on a side stream through pinned memory
(:mod:`.device_copy`).
A write-back that finds more than ``max_pending_bytes`` still queued is dropped (counted),
never waited for: the step never blocks on the tier.

Restore (:meth:`RankTier.restore`) fetches one run for the step and copies it into the pool
blocks it was given, or reports failure (missing, timed out, the tier's actor gone, a run of
the wrong shape) without having written anything; the caller then recomputes.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvfleet.worker.kv_tier.device_copy import device_copies
from kvfleet.worker.kv_tier.store import TierStore
from kvfleet.worker.runner.kv_cache import KVCache

log = logging.getLogger(__name__)
DEFAULT_MAX_PENDING_BYTES = 64 << 20


@dataclass
class RankTierStats:
    """Counters of one rank (blocks, and bytes as integers)."""

    write_backs: int = 0          # blocks put into the tier
    dropped_write_backs: int = 0  # blocks not written back (queue full or put failed)
    restores: int = 0             # blocks copied from the tier into the pool
    failed_restores: int = 0      # restore calls that failed (the step recomputed instead)
    bytes_written: int = 0
    bytes_restored: int = 0


class RankTier:
    """The tier as rank ``rank`` of a replica uses it, over that rank's ``kv_cache``; its
    write-backs carry ``tag`` (the replica's model identity digest, :meth:`HostTierStore.hottest`).

    Blocks travel as raw bytes (``uint8`` over the last dimension), block-major: one block is
    ``(num_layers, 2, block_size, num_local_kv_heads, head_dim × element size)``.
    """

    enabled = True  # see NoRankTier

    def __init__(self, store: TierStore, rank: int, kv_cache: KVCache,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, tag: bytes = b"") -> None:
        self.store, self.rank, self.kv = store, rank, kv_cache
        self.tag = tag  # the replica's model identity, kept with its blocks (pre-warm)
        self.max_pending_bytes = max_pending_bytes
        self.stats = RankTierStats()
        self.copies = device_copies(kv_cache.data.device)
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._writer, daemon=True,
                                        name=f"kv-tier-writer-{rank}")
        self._thread.start()

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's wire shape (uint8 last dimension)."""
        d = self.kv.data
        return (d.shape[0], 2, d.shape[3], d.shape[4], d.shape[5] * d.element_size())

    # ---- write-back ------------------------------------------------------------------------
    def save(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Snapshot ``blocks`` (registered under ``hashes``) and queue their write-back; or
        drop them if too much is queued already. Returns at once after the copy."""
        if not blocks:
            return
        nbytes = len(blocks) * int(np.prod(self.block_shape))
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.dropped_write_backs += len(blocks)
                return
            self._pending_bytes += nbytes
        self._queue.put((list(hashes), self.copies.snapshot(self.kv.data, blocks), nbytes))

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            hashes, snapshot, nbytes = item
            try:
                run = snapshot()  # (n, L, 2, bs, H, D) on the host
                self.store.put(self.rank, hashes, run.view(torch.uint8).numpy(), self.tag)
                with self._lock:
                    self.stats.write_backs += len(hashes)
                    self.stats.bytes_written += nbytes
            except Exception as exc:  # a dead tier: the blocks are simply not kept
                log.warning("kv tier write-back of %d blocks failed: %s", len(hashes), str(exc))
                with self._lock:
                    self.stats.dropped_write_backs += len(hashes)
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                    self._idle.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write-back has finished (tests, drain); True if it did."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending_bytes == 0, timeout_s)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    # ---- restore ---------------------------------------------------------------------------
    def restore(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> bool:
        """Copy the tier's blocks under ``hashes`` into pool ``blocks`` (one run, one copy).
        Returns False, having written nothing, when the run cannot be had."""
        if not blocks:
            return True
        try:
            run = self.store.get(self.rank, list(hashes))
        except Exception as exc:  # the tier's actor died or timed out: recompute
            log.warning("kv tier restore of %d blocks failed: %s", len(blocks), str(exc))
            run = None
        if run is None or run.shape != (len(blocks), *self.block_shape) or run.dtype != np.uint8:
            self.stats.failed_restores += 1
            return False
        with warnings.catch_warnings():  # a same-node run is a read-only view: only read here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(run)
        self.copies.restore(self.kv.data, blocks, src.view(self.kv.data.dtype))
        self.stats.restores += len(blocks)
        self.stats.bytes_restored += run.nbytes
        return True

    def counters(self) -> dict[str, int]:
        """This rank's counters (:class:`RankTierStats`) as a dict (bytes are integers)."""
        with self._lock:
            return dataclasses.asdict(self.stats)

    def close(self) -> None:
        """Stop the writer thread after the write-backs already queued (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5.0)


class NoRankTier:
    """A rank of a replica without a host tier: write-backs are dropped, a restore of any
    block fails (the engine recomputes), nothing is ever pending."""

    enabled = False

    def save(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Nothing is kept."""

    def restore(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> bool:
        return not blocks

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Nothing to stop."""


NO_RANK_TIER = NoRankTier()
BlockMoves = Sequence[tuple[int, bytes]]  # (pool block, chain hash)


def transfer(tier: RankTier | NoRankTier, saves: BlockMoves, restores: BlockMoves) -> bool:
    """One rank's part of a step's block moves: snapshot ``saves`` for write-back, then fill
    ``restores`` from the tier. True when every restore landed (no tier: only if none asked)."""
    tier.save([b for b, _ in saves], [h for _, h in saves])
    return tier.restore([b for b, _ in restores], [h for _, h in restores])
