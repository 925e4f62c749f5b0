"""One rank's side of the host tier: write back evicted blocks, restore hit blocks.

Write-back (:meth:`RankTier.save`) runs on the step path but only copies: the evicted blocks'
K/V are gathered into fresh tensors (one memory copy; the pool may overwrite the blocks as
soon as this returns) and handed to a background thread, which puts them into the tier in
runs of at most ``max_run_bytes`` (one put call, one object in Ray's object store, each).
On CUDA the gather and the device → host copy run on a side stream through pinned memory
(:mod:`.device_copy`).
At most ``max_pending_bytes`` are queued at a time: a save queues the leading blocks that fit
and drops (counts) the rest, never waiting: the step never blocks on the tier. Each queued
run has its own completion (:class:`Saved`), so a caller that needs its blocks in the tier (a
peer's export) waits for its own puts, not for the writer to go idle.

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
from concurrent.futures import Future, InvalidStateError, wait
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvfleet.worker.kv_tier.device_copy import device_copies
from kvfleet.worker.kv_tier.store import TierStore
from kvfleet.worker.runner.kv_cache import KVCache

log = logging.getLogger(__name__)
DEFAULT_MAX_PENDING_BYTES = 64 << 20  # write-back bytes queued at once (--kv-write-back-queue)
DEFAULT_MAX_RUN_BYTES = 16 << 20  # bytes of one put call


@dataclass(frozen=True)
class Saved:
    """What one :meth:`RankTier.save` queued: its leading ``blocks`` (the rest were dropped),
    in runs of ``sizes`` blocks, each with its completion (same order): a
    :class:`~concurrent.futures.Future` set to True once the run is in the tier, False when
    its put failed (never an exception)."""

    blocks: int = 0
    completions: tuple[Future, ...] = field(default_factory=tuple)
    sizes: tuple[int, ...] = ()

    def landed(self, timeout_s: float) -> int:
        """Wait at most ``timeout_s`` in all; the leading blocks whose runs are in the tier."""
        wait(self.completions, timeout_s)
        n = 0
        for done, size in zip(self.completions, self.sizes, strict=True):
            if not (done.done() and done.result()):
                break
            n += size
        return n


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
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, tag: bytes = b"",
                 max_run_bytes: int = DEFAULT_MAX_RUN_BYTES) -> None:
        if max_pending_bytes < 0 or max_run_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be >= 0 and max_run_bytes > 0, got "
                             f"{max_pending_bytes} and {max_run_bytes}")
        self.store, self.rank, self.kv = store, rank, kv_cache
        self.tag = tag  # the replica's model identity, kept with its blocks (pre-warm)
        self.max_pending_bytes, self.max_run_bytes = max_pending_bytes, max_run_bytes
        # The last save's runs (engine thread): what an export that just transferred waits on.
        self.last_saved = Saved()
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
    def save(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Snapshot the leading ``blocks`` (registered under ``hashes``) that fit in the
        queue's room and queue their write-back, in runs of at most ``max_run_bytes``; the
        rest are dropped (counted). Returns the blocks queued at once, after the copy (also
        :attr:`last_saved`, with each run's completion). Never raises: a snapshot that fails
        drops its blocks and gives their room back."""
        self.last_saved = Saved()
        if not blocks:
            return 0
        block_bytes = int(np.prod(self.block_shape))
        with self._lock:
            room = max(0, self.max_pending_bytes - self._pending_bytes) // block_bytes
            n = min(len(blocks), room)
            self._pending_bytes += n * block_bytes
            self.stats.dropped_write_backs += len(blocks) - n
        per_run = max(1, self.max_run_bytes // block_bytes)
        queued, completions, sizes = 0, [], []
        try:
            for i in range(0, n, per_run):
                run = list(blocks[i:min(n, i + per_run)])
                snapshot = self.copies.snapshot(self.kv.data, run)
                done: Future = Future()
                self._queue.put((list(hashes[i:i + len(run)]), snapshot, len(run) * block_bytes,
                                 done))
                queued += len(run)
                completions.append(done)
                sizes.append(len(run))
        except Exception as exc:  # e.g. no pinned memory: these blocks are simply not kept
            log.warning("kv tier snapshot of %d blocks failed: %s", n - queued, str(exc))
        finally:
            if queued < n:  # the room taken for blocks never queued goes back
                with self._lock:
                    self._pending_bytes -= (n - queued) * block_bytes
                    self.stats.dropped_write_backs += n - queued
                    self._idle.notify_all()
        self.last_saved = Saved(queued, tuple(completions), tuple(sizes))
        return queued

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            hashes, snapshot, nbytes, done = item
            landed = False
            try:
                run = snapshot()  # (n, L, 2, bs, H, D) on the host
                self.store.put(self.rank, hashes, run.view(torch.uint8).numpy(), self.tag)
                landed = True
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
                _complete(done, landed)

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


def _complete(done: Future, landed: bool) -> None:
    try:
        done.set_result(landed)
    except InvalidStateError:  # its waiter gave up (cancelled): nobody reads it
        pass


class NoRankTier:
    """A rank of a replica without a host tier: write-backs are dropped, a restore of any
    block fails (the engine recomputes), nothing is ever pending."""

    enabled = False
    last_saved = Saved()

    def save(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Nothing is kept: 0 queued."""
        return 0

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
