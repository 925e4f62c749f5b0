"""Exports for a peer replica (issue 26 §2): the leading run of requested blocks this replica
holds goes to the node's host tier with the next step's write-backs.

An export is asked between steps (engine thread). Its blocks are looked up in the prefix cache
and **referenced** at once (a block table of their own in the KV cache manager), so the
scheduler's next allocations cannot evict and reuse them before their KV is read; the next
step's block moves (``StepPlan.block_saves``, :mod:`.moves`) snapshot them on every rank
with that step's evicted blocks, and then the references go (:meth:`TierExports.moved`). The
rank's writer thread puts the snapshot into the tier in the background, as it does every
write-back; the caller waits for that put, not the engine.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.worker.engine.scheduling.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# Called on the engine thread once the blocks were snapshotted: the hashes exported, in order.
ExportDone = Callable[[tuple[bytes, ...]], None]


@dataclass(frozen=True)
class _Export:
    owner: str                  # its block table in the KV cache manager (the references)
    moves: tuple[tuple[int, bytes], ...]  # (pool block, the hash it is registered under)
    done: ExportDone


class TierExports:
    """Exports waiting for the next step's block moves, over ``kv``."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._pending: list[_Export] = []
        self._ids = itertools.count()
        self.exported_blocks = 0  # blocks snapshotted for a peer (metrics)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def request(self, hashes: Sequence[bytes], done: ExportDone) -> int:
        """Reference the leading run of ``hashes`` held in the pool, up to a repeated one, for
        the next step's moves (``done`` is called after them). Returns the blocks found; with
        none, ``done(())`` is called at once."""
        blocks: list[int] = []
        seen: set[bytes] = set()
        for h in hashes:
            block = self.kv.pool.lookup(h)
            if block is None or h in seen:  # a repeat is no chain (and would over-count free)
                break
            seen.add(h)
            blocks.append(block)
        if not blocks:
            done(())
            return 0
        owner = f"{next(self._ids)}#export"  # a sequence id ends in "#<sample index>"
        taken = self.kv.allocate_slots(owner, len(blocks) * self.kv.block_size, blocks)
        assert taken == [], "cached blocks are free or referenced: taking them needs none"
        # The hash each block is registered under (not an echo of the request): what a peer
        # checks against its own chain.
        moves = tuple((b, self.kv.pool.block_hash(b)) for b in blocks)
        assert all(h is not None for _, h in moves), "a looked-up block lost its hash"
        self._pending.append(_Export(owner, moves, done))  # type: ignore[arg-type]
        return len(blocks)

    def attach(self, out: SchedulerOutput) -> SchedulerOutput:
        """``out`` with the pending exports' blocks added to its write-backs."""
        if not self._pending:
            return out
        extra = tuple(m for e in self._pending for m in e.moves)
        return replace(out, plan=replace(out.plan, block_saves=out.plan.block_saves + extra))

    def moved(self, saved: bool) -> None:
        """The step's moves ran: drop the references and tell each caller what was exported
        (nothing unless ``saved``: the snapshots were taken)."""
        pending, self._pending = self._pending, []
        for e in pending:
            self.kv.free(e.owner)
            self.exported_blocks += len(e.moves) if saved else 0
            try:
                e.done(tuple(h for _, h in e.moves) if saved else ())
            except Exception:  # a caller's callback never fails the step
                log.exception("export callback failed")
