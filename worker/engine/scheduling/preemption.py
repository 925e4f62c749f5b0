"""Before a step: waiting sequences of a higher class preempt lower-class running ones.

Under the ``watermark`` policy, a waiting sequence that finds no seat or too few blocks for
its first chunk may preempt (by recompute) running sequences of a lower class
(:meth:`~.priority_queue.PriorityRules.victims`: those that have not streamed a token yet,
all with ``preempt_streaming``), one at a time, lowest class and newest first. Waiting
sequences are served in queue order (best class first) and the seats and blocks each
claims are counted for the next, so a burst of higher-class arrivals gets its seats in one
step, not one a step — up to the step's token budget: it stops once the first chunks made
room for fill ``max_num_batched_tokens``. With ``tenant_share`` below 1 a sequence whose
tenant may not take another seat (:class:`~.seats.TenantSeats`) stops it too: its
tenant's share, not the class, holds it back.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.priority_queue import head_class
from kvfleet.worker.engine.scheduling.seats import group_size, seats_taken

if TYPE_CHECKING:  # only for annotations: the scheduler imports this module
    from kvfleet.worker.engine.scheduling.scheduler import Scheduler


def preempt_for_higher_class(sched: Scheduler) -> list[SequenceState]:
    """Let ``sched``'s waiting sequences, best class first, each take a seat and blocks for
    its first chunk from running sequences of a lower class, preempting them one at a time
    (:meth:`Scheduler.preempt`). Stops at the first that finds no victim (or, with
    ``tenant_share`` < 1, whose tenant may not take a seat), or once the first chunks made
    room for fill the step's token budget.

    Returns:
        The sequences preempted, in order (now waiting again).
    """
    config, kv = sched.config, sched.kv
    preempted: list[SequenceState] = []
    claimed_seats = claimed_blocks = tokens = 0
    claimed_by_tenant: Counter = Counter()
    waiting = {s.tenant for s in head_class(sched.waiting)}
    for seq in list(sched.waiting):
        if tokens >= config.max_num_batched_tokens:
            break
        group = group_size(seq, sched.pending_forks)
        victims = None  # rules.victims over today's running list, once per preemption
        if config.tenant_share < 1:  # its tenant's share, not the class, may hold it back
            victims = sched.rules.victims(seq, sched.running)
            held = (claimed_by_tenant[seq.tenant]  # victims are running sequences
                    + sum(1 for s in sched.running if s.tenant == seq.tenant)
                    - sum(1 for s in victims if s.tenant == seq.tenant))
            if not sched.seats.may_take(seq.tenant, held, group, waiting):
                break
        while True:
            computed = kv.get_computed_blocks(seq.block_hashes, seq.num_tokens)
            num_cached = len(computed) * kv.block_size
            chunk = min(seq.num_tokens - num_cached, config.max_num_batched_tokens)
            if (seats_taken(sched.running, sched.pending_forks) + claimed_seats + group
                    <= config.max_num_seqs
                    and sched.blocks.admissible(seq, computed, num_cached + chunk, sched.running,
                                                sched.pending_forks, claimed_blocks)):
                break
            if victims is None:
                victims = sched.rules.victims(seq, sched.running)
            if not victims:
                return preempted
            sched.preempt(victims[0])
            preempted.append(victims[0])
            victims = None  # the running list changed
        claimed_seats += group
        claimed_by_tenant[seq.tenant] += group
        claimed_blocks += sched.blocks.new_blocks(computed, num_cached + chunk)
        tokens += chunk
    return preempted
