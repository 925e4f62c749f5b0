"""Put drafts on a planned step's decode rows: the scheduler's last pass when speculation is on.

Drafts use what the step left: the token budget after decodes and prefill chunks, and free
KV blocks — under ``watermark`` only beyond the watermark, under ``reserve`` within the row's
own reservation (a row never drafts past ``prompt + max_tokens``). A draft never preempts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvfleet.worker.engine.scheduling.output import ScheduledSeq
from kvfleet.worker.step_cost.model import StepShape, attended

if TYPE_CHECKING:  # annotations only
    from kvfleet.worker.engine.scheduling.admission import StepWork
    from kvfleet.worker.engine.scheduling.scheduler import Scheduler


def _shape(scheduled: Sequence[ScheduledSeq]) -> StepShape:
    decode = prefill = context = 0
    for s in scheduled:
        n = s.num_new_tokens
        decode, prefill = (decode + 1, prefill) if n == 1 else (decode, prefill + n)
        context += attended(s.seq.num_computed_tokens, n)
    return StepShape(decode, prefill, context, 0)


def add_drafts(sched: Scheduler, scheduled: list[ScheduledSeq], tokens_left: int,
               work: StepWork) -> list[ScheduledSeq]:
    """``scheduled`` with drafts on the decode rows the speculator sizes them for (blocks for
    them allocated here; a row whose blocks do not fit drafts fewer or none)."""
    rows = [i for i, s in enumerate(scheduled)
            if s.sample and s.num_new_tokens == 1 and s.seq.seq_id not in sched.pending_forks
            and sched.spec.eligible(s.seq)]
    if not rows or tokens_left <= 0:
        return scheduled
    seqs = [scheduled[i].seq for i in rows]
    sampled = sum(1 for s in scheduled if s.sample)
    drafts = sched.spec.plan(seqs, _shape(scheduled), sampled, sched.step_cost, tokens_left)
    out = list(scheduled)
    reserve = sched.config.policy == "reserve"
    for i, seq, d in zip(rows, seqs, drafts, strict=True):
        while d:  # fewer drafts until their blocks fit
            want = seq.num_computed_tokens + 1 + len(d)
            new = sched.kv.new_blocks(seq.seq_id, want)  # over every layer group
            spare = sched.kv.num_free_blocks - (0 if reserve else sched.blocks.watermark_blocks)
            if new <= 0 or new <= spare:
                break
            d = d[:-1]
        if d:
            allocated = sched.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + 1 + len(d),
                                                evicted=work.evicted)
            assert allocated is not None, "free blocks were counted just above"
            out[i] = ScheduledSeq(seq, 1, True, d)
    return out
