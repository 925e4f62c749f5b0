"""The scheduler's preemption counter (``Scheduler.preemptions``, exported as
``kvfleet.worker.preemptions``): each preemption by recompute counts once, under its reason;
a failed tier restore's undo is no preemption."""

from __future__ import annotations

from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.engine.request import SeqStatus
from kvfleet.worker.engine.scheduling.preemption import BLOCKS, CLASS, REASONS, TENANT_SEAT
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from tests.unit.worker.engine.scheduling.test_tenant_preempt import late_b, seats_full
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq, run_step


def counts(s: Scheduler) -> dict[str, int]:
    return {r: s.preemptions[r] for r in REASONS}


def test_a_sequence_that_cannot_grow_counts_as_blocks():
    s = make_scheduler(4, watermark=0.0)
    old, new = new_seq(prompt_len=4), new_seq(prompt_len=4)
    s.add([old, new])
    preempted = [x for _ in range(20) for x in run_step(s).preempted]
    assert preempted and preempted[0] is new  # both needed a 3rd block: none was free
    assert counts(s) == {BLOCKS: len(preempted), CLASS: 0, TENANT_SEAT: 0}


def test_a_higher_class_taking_a_seat_counts_as_class():
    s = make_scheduler(32, max_num_seqs=1, class_headroom=0)
    low = new_seq(prompt_len=4, priority=BATCH)
    s.add([low])
    run_step(s)
    s.add([new_seq(prompt_len=4, priority=INTERACTIVE)])
    out = run_step(s)
    assert out.preempted == (low,)
    assert counts(s) == {BLOCKS: 0, CLASS: 1, TENANT_SEAT: 0}


def test_a_seat_for_the_tenant_behind_counts_as_tenant_seat():
    s, _ = seats_full(a_ahead_by=5000)
    late = late_b(s)
    preempted = [x for _ in range(3) for x in run_step(s).preempted]
    assert len(preempted) == 1 and late.status is SeqStatus.RUNNING
    assert counts(s) == {BLOCKS: 0, CLASS: 0, TENANT_SEAT: 1}


def test_an_undone_restore_is_no_preemption():
    s = make_scheduler(32)
    x = new_seq(prompt_len=4)
    s.add([x])
    run_step(s)
    s.preempt(x, count=False)
    assert x.status is SeqStatus.WAITING and sum(s.preemptions.values()) == 0
