"""Parallel sampling (``n > 1``): siblings that wait beside their leader, then fork its blocks.

Only sample 0 (the *leader*) is queued; its siblings wait beside it (the scheduler's
``pending_forks``, holding their running seats: :func:`~.seats.group_size`). When the
leader's prompt is fully computed they fork its block table (one more reference per block, no
KV computed twice) and join the running set, each sampling its first token from the leader's
logits. The prompt's partially filled last block is then shared: before a sequence writes
into a shared block, the scheduler gives it a private copy (``StepPlan.block_copies``,
copy-on-write), so no sibling ever writes a block another reads.
"""

from __future__ import annotations

from typing import Iterable

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.output import Fork


def fork_siblings(kv: KVCacheManager, leader: SequenceState, siblings: Iterable[SequenceState]
                  ) -> list[Fork]:
    """Give each of ``siblings`` a reference to every block of ``leader`` (whose prompt is
    computed) and mark it running with the leader's computed and cached token counts.

    Returns:
        One :class:`Fork` a sibling, in order; the caller adds the siblings to its running set.
    """
    forks = []
    for sib in siblings:
        kv.fork(leader.seq_id, sib.seq_id)
        sib.status = SeqStatus.RUNNING
        sib.num_computed_tokens = leader.num_computed_tokens
        sib.num_cached_tokens = leader.num_cached_tokens
        forks.append(Fork(leader, sib))
    return forks


def drop_sibling(pending: dict[str, list[SequenceState]], seq: SequenceState) -> bool:
    """Remove ``seq`` from the siblings waiting in ``pending`` (leader seq_id -> siblings),
    dropping a leader left with none. Returns whether ``seq`` was there."""
    found = False
    for leader_id, siblings in list(pending.items()):
        if seq in siblings:
            found = True
            siblings.remove(seq)
            if not siblings:
                del pending[leader_id]
    return found
