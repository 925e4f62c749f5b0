"""Admission's host-tier part: which blocks a waiting sequence restores instead of computing,
and what becomes of them once the engine has moved them (or failed to).

The scheduler asks :meth:`TierAdmission.hits` after the device pool: the chain's next blocks,
up to the reuse limit (the prompt's last token is always computed), that the tier holds for
every rank. An admitted sequence's restored blocks are fresh pool blocks at the table
positions after its device hits; the plan lists them (``StepPlan.block_restores``) and the
engine restores them before the forward. They are registered in the prefix cache only once
their KV is in place (:meth:`restored`); if any rank could not restore, :meth:`undo` puts the
sequences back to wait (and recompute: they skip the tier next time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.kv_tier.lookup import TierLookup


@dataclass(frozen=True)
class _Restore:
    seq: SequenceState
    first: int            # index of its first restored block in the block table
    hashes: tuple[bytes, ...]


class TierAdmission:
    """The restores of the step being planned, over ``kv`` and the tier's ``lookup``."""

    def __init__(self, kv: KVCacheManager, lookup: TierLookup) -> None:
        self.kv, self.lookup = kv, lookup
        self._planned: list[_Restore] = []
        self.restored_blocks = 0  # blocks restored into the pool (metrics)

    def hits(self, seq: SequenceState, num_device_blocks: int) -> tuple[bytes, ...]:
        """Hashes of the blocks after the device hits that the tier can restore for ``seq``."""
        if seq.tier_skip:
            return ()
        limit = max(0, (seq.num_tokens - 1) // self.kv.block_size)
        wanted = seq.block_hashes[num_device_blocks:limit]
        return tuple(wanted[:self.lookup.lookup(wanted)])

    def admitted(self, seq: SequenceState, num_device_blocks: int, hashes: Sequence[bytes]) -> None:
        """``seq`` was admitted with ``hashes`` to restore after its device blocks."""
        if hashes:
            self._planned.append(_Restore(seq, num_device_blocks, tuple(hashes)))

    def take_restores(self) -> tuple[tuple[int, bytes], ...]:
        """``(block, hash)`` of every restore planned this step (for the plan)."""
        out: list[tuple[int, bytes]] = []
        for r in self._planned:
            table = self.kv.block_table(r.seq.seq_id)
            out += zip(table[r.first:r.first + len(r.hashes)], r.hashes, strict=True)
        return tuple(out)

    def restored(self) -> None:
        """Every rank restored this step's blocks: register them in the prefix cache."""
        for r in self._planned:
            end = (r.first + len(r.hashes)) * self.kv.block_size
            self.kv.cache_full_blocks(r.seq.seq_id, r.seq.block_hashes, end,
                                      from_token=r.first * self.kv.block_size)
            self.restored_blocks += len(r.hashes)
        self._planned.clear()

    def undo(self, preempt: Callable[[SequenceState], None]) -> None:
        """A restore failed: ``preempt`` each restoring sequence (its blocks are freed; the
        unregistered restore targets go back to the free list) so it recomputes, and back off
        the tier for a moment."""
        self.lookup.mark_down()
        for r in self._planned:
            r.seq.tier_skip = True
            r.seq.num_cached_tokens = None  # counted again at its real admission
            preempt(r.seq)
        self._planned.clear()
