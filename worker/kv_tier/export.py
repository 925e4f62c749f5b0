"""Exports for a peer replica: the leading run of requested blocks this replica holds goes to
the node's host tier at once.

An export is asked between steps (engine thread). Its blocks are looked up in the prefix cache
and snapshotted on every rank right away (:meth:`Executor.transfer_blocks`, write-backs only),
as a drain's hand-over is: nothing is referenced across a step, so an export never takes
blocks that admission counted as free. Each rank's writer thread puts the snapshot into the
tier in the background, as it does every write-back; the caller waits for those puts (rank
0's :class:`~.rank_tier.Saved` completions of this export), not for the engine nor for the
writer to go idle.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvfleet.allocator.kv_cache_manager import KVCacheManager, is_group_key
from kvfleet.worker.executor.base import Executor

log = logging.getLogger(__name__)

# Called on the engine thread once the blocks were snapshotted: the hashes exported, in order.
ExportDone = Callable[[tuple[bytes, ...]], None]


def held_run(kv: KVCacheManager, hashes: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """``(pool block, hash)`` of the leading run of ``hashes`` registered in ``kv``'s pool, up
    to a repeated hash (a repeat is no chain). The hash is the one each block is registered
    under (not an echo of the request): what a peer checks against its own chain."""
    moves: list[tuple[int, bytes]] = []
    seen: set[bytes] = set()
    for h in hashes:
        block = kv.pool.lookup(h)
        if block is None or h in seen:
            break
        seen.add(h)
        registered = kv.pool.block_hash(block)
        assert registered is not None, "a looked-up block lost its hash"
        moves.append((block, registered))
    return moves


def export_moves(kv: KVCacheManager, hashes: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """:func:`held_run`, with layer groups each block followed by the other groups' pages of
    it that the pool still holds, under their own keys (a sliding group's page may be gone:
    the peer's admission then restores the hit its window allows)."""
    run = held_run(kv, hashes)
    if not kv.grouped:
        return run
    moves: list[tuple[int, bytes]] = []
    for block, h in run:
        moves.append((block, h))
        for g in range(1, kv.num_groups):
            page = kv.pool.lookup(kv.key(g, h))
            if page is not None:
                moves.append((page, kv.key(g, h)))
    return moves


class TierExports:
    """Exports of one replica's blocks (``kv``) through the ranks of ``executor()`` (the
    engine's executor at the time of the export)."""

    def __init__(self, kv: KVCacheManager, executor: Callable[[], Executor]) -> None:
        self.kv, self.executor = kv, executor
        self.exported_blocks = 0  # blocks snapshotted for a peer (metrics)

    def request(self, hashes: Sequence[bytes], done: ExportDone) -> int:
        """Snapshot the leading run of ``hashes`` held in the pool for write-back, then call
        ``done`` with the hashes queued for the tier (``()`` when none is held, rank 0's
        write-back queue had no room, or the transfer call failed); their puts' completions
        are then rank 0's ``tier.last_saved``. Returns the pages found."""
        moves = export_moves(self.kv, hashes)
        exported: tuple[bytes, ...] = ()
        if moves:
            try:
                executor = self.executor()
                executor.transfer_blocks(moves, ())
                queued = executor.tier.last_saved.blocks  # rank 0's: what it will answer
                exported = tuple(h for _, h in moves[:queued] if not is_group_key(h))
                self.exported_blocks += len(exported)
            except Exception:  # a rank failed: the replica's own checks report it
                log.exception("export of %d blocks failed", len(moves))
        try:
            done(exported)
        except Exception:  # a caller's callback never fails the engine thread
            log.exception("export callback failed")
        return len(moves)
