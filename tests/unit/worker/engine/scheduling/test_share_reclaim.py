"""A seat lent past a tenant's share comes back to a tenant under its share
(``preempt_for_share``, ``tenant_share`` < 1): within the service credit, the tenant whose whole
demand fits its share takes the lender's newest row's seat at once, and is admitted into it;
never for a tenant asking past its share, never from a lender behind by more than the credit,
never back and forth."""

from __future__ import annotations

from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.preemption import TENANT_SEAT
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from tests.unit.worker.scheduler_harness import (
    held,
    make_scheduler,
    new_seq,
    run_step,
    two_tenants_seated,
)


def a_past_its_share(b_ahead_by: float = 100.0) -> tuple[Scheduler, list[SequenceState]]:
    """6 seats (3 a tenant's share): b, served ``b_ahead_by`` more, waits while a is admitted,
    so service lends a a fourth seat; then b's two prompts take the rest: a 4, b 2, every seat
    held. Returns the scheduler and a's running sequences."""
    s = make_scheduler(256, max_num_seqs=6, tenant_share=0.5)
    a, _ = two_tenants_seated(s, 4, 2, "b", b_ahead_by)
    assert (held(s, "a"), held(s, "b"), len(s.waiting)) == (4, 2, 0)
    return s, a


def late_b(s: Scheduler, n: int = 1) -> list[SequenceState]:
    late = [new_seq(prompt_len=4, max_tokens=50, tenant="b") for _ in range(n)]
    s.add(late)
    return late


def test_the_tenant_under_its_share_takes_back_the_lent_seat_at_once():
    s, a = a_past_its_share()
    gap = s.service.service["b"] - s.service.service["a"]
    assert 0 < gap <= s.service.credit  # b ahead of a, within the credit: no tenant-seat rule
    (late,) = late_b(s)
    out = run_step(s)
    newest = max(a, key=lambda x: x.arrival_seq)
    assert out.preempted == (newest,) and newest.status is SeqStatus.WAITING
    assert late in s.running and late in [x.seq for x in out.scheduled]
    assert (held(s, "a"), held(s, "b")) == (3, 3)
    assert s.preemptions[TENANT_SEAT] == 1 and newest.class_preemptions == 1
    s.kv.check_invariants()


def test_no_back_and_forth():
    s, _ = a_past_its_share()
    late_b(s)
    preempted = [x for _ in range(12) for x in run_step(s).preempted]
    assert [x.tenant for x in preempted] == ["a"]  # a, at its share now, never takes it back
    assert (held(s, "a"), held(s, "b")) == (3, 3)


def test_a_tenant_asking_past_its_share_competes_by_service_alone():
    s, _ = a_past_its_share()
    late = late_b(s, 2)  # b's demand: 2 running + 2 waiting, past its share of 3
    for _ in range(4):
        assert not run_step(s).preempted
    assert all(x.status is SeqStatus.WAITING for x in late)


def test_a_lender_behind_by_more_than_the_credit_keeps_its_seats():
    s, _ = a_past_its_share(b_ahead_by=5000)
    (late,) = late_b(s)
    for _ in range(4):
        assert not run_step(s).preempted
    assert late.status is SeqStatus.WAITING and held(s, "a") == 4


def test_switched_off_nothing_is_preempted():
    s, _ = a_past_its_share()
    s.tenant_preempt = False
    (late,) = late_b(s)
    for _ in range(4):
        assert not run_step(s).preempted
    assert late.status is SeqStatus.WAITING


def test_everything_finishes_and_no_block_leaks():
    s, _ = a_past_its_share()
    late_b(s)
    for _ in range(400):
        if not s.num_unfinished:
            break
        run_step(s, finish=True)
    assert not s.num_unfinished
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    s.service.check_invariants()


def test_beside_free_seats_the_tenant_within_its_share_is_not_held_back_by_a_hair():
    """a at its share (3 of 6) and a hair behind b in service, b running 1: a's next prompt is
    the service pick (lent a fourth seat) and would hold b's back for the step; b, asking no
    more than its share, goes first instead."""
    s = make_scheduler(256, max_num_seqs=6, tenant_share=0.5)
    a = [new_seq(prompt_len=4, max_tokens=50, tenant="a") for _ in range(3)]
    b = new_seq(prompt_len=4, max_tokens=50, tenant="b")
    s.add(a + [b])
    s.service.charge("b", prefill_tokens=100)
    for _ in range(2):
        run_step(s)
    assert (held(s, "a"), held(s, "b")) == (3, 1)
    assert 0 < s.service.service["b"] - s.service.service["a"] <= s.service.credit
    late_a = new_seq(prompt_len=4, max_tokens=50, tenant="a")
    s.add([late_a])
    (late,) = late_b(s)
    out = run_step(s)
    assert not out.preempted
    assert late in [x.seq for x in out.scheduled]
    assert late.status is SeqStatus.RUNNING
