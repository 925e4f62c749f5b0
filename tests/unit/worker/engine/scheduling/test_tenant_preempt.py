"""A seat for the tenant behind (``preempt_for_behind_tenant``, ``tenant_share`` < 1): a prompt of a
tenant served less than another of its class, finding every seat held, takes the other's newest
running sequence's seat at once, or after waiting one step where a running row ends in the step;
never within the service credit, never from a tenant served less, never back and forth."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.priority_queue import MAX_CLASS_PREEMPTIONS
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from tests.unit.worker.scheduler_harness import (
    held,
    make_scheduler,
    new_seq,
    run_step,
    two_tenants_seated,
)


def seats_full(a_ahead_by: float, tenant_share: float = 0.5, policy: str = "watermark"
               ) -> tuple[Scheduler, list[SequenceState]]:
    """6 seats (3 a tenant's share): b runs 4 long sequences (lent past its share while a,
    served ``a_ahead_by`` more, waited), a runs 2 and has 2 more waiting: every seat held.
    Returns the scheduler and a's running sequences, oldest first."""
    s = make_scheduler(256, max_num_seqs=6, tenant_share=tenant_share, policy=policy)
    a, _ = two_tenants_seated(s, 4, 4, "a", a_ahead_by)
    assert len(s.running) == 6
    return s, [x for x in a if x in s.running]


def late_b(s: Scheduler) -> SequenceState:
    late = new_seq(prompt_len=4, max_tokens=50, tenant="b")
    s.add([late])
    return late


def assert_keeps_waiting(s, late) -> None:
    """Four steps preempt nothing and ``late`` is still waiting for a seat."""
    for _ in range(4):
        assert not run_step(s).preempted
    assert late.status is SeqStatus.WAITING


def test_the_tenant_behind_gets_a_seat_at_once_when_no_seat_comes_back_at_the_step():
    s, a_running = seats_full(a_ahead_by=5000)
    assert (held(s, "a"), held(s, "b")) == (2, 4)
    late = late_b(s)
    out = run_step(s)  # no running row samples its last token in this step: no wait
    newest = max(a_running, key=lambda x: x.arrival_seq)
    assert out.preempted == (newest,) and late in s.running
    assert newest.status is SeqStatus.WAITING and newest.class_preemptions == 1
    assert (held(s, "a"), held(s, "b")) == (1, 5)
    s.kv.check_invariants()


def test_it_waits_one_step_for_a_seat_the_step_gives_back():
    s, a_running = seats_full(a_ahead_by=5000)
    ending = max(a_running, key=lambda x: x.arrival_seq)
    # its next token is its last
    ending.params = dataclasses.replace(ending.params, max_tokens=len(ending.output_token_ids) + 1)
    late = late_b(s)
    out = run_step(s, finish=True)
    assert not out.preempted and late.status is SeqStatus.WAITING  # a seat comes back
    assert ending.is_finished
    out = run_step(s, finish=True)
    assert not out.preempted and late in s.running  # it took the seat given back
    assert s.preemptions["tenant_seat"] == 0


def test_no_back_and_forth():
    s, _ = seats_full(a_ahead_by=5000)
    late_b(s)
    preempted = [x for _ in range(12) for x in run_step(s).preempted]
    assert [x.tenant for x in preempted] == ["a"]  # a, now waiting, never takes it back


def test_within_the_credit_nobody_is_preempted():
    s, _ = seats_full(a_ahead_by=s_credit() / 2)
    late = late_b(s)
    assert_keeps_waiting(s, late)  # waits for a finish, as before


def s_credit() -> float:
    return make_scheduler(8, max_num_seqs=6, tenant_share=0.5).service.credit


def test_the_tenant_ahead_is_the_victim_never_the_one_behind():
    s, _ = seats_full(a_ahead_by=5000)
    s.service.charge("b", prefill_tokens=20000)  # now b is far ahead of a
    late = late_b(s)
    preempted = [x for _ in range(6) for x in run_step(s).preempted]
    # a's waiting prompts (a behind now) take b's newest seats; b's late prompt takes none of a's
    assert preempted and {x.tenant for x in preempted} == {"b"}
    assert late.status is SeqStatus.WAITING and held(s, "a") > 2


@pytest.mark.parametrize("tenant_share, policy", [(1.0, "watermark"), (0.5, "reserve")])
def test_only_where_seats_are_divided_under_watermark(tenant_share: float, policy: str):
    s, _ = seats_full(a_ahead_by=5000, tenant_share=tenant_share, policy=policy)
    late = late_b(s)
    assert_keeps_waiting(s, late)


def test_a_sequence_preempted_to_the_bound_is_no_victim():
    s, a_running = seats_full(a_ahead_by=5000)
    for x in a_running:
        x.class_preemptions = MAX_CLASS_PREEMPTIONS
    late = late_b(s)
    assert_keeps_waiting(s, late)


def test_switched_off_nothing_is_preempted():
    s, _ = seats_full(a_ahead_by=5000)
    s.tenant_preempt = False
    late = late_b(s)
    assert_keeps_waiting(s, late)


def finish_all(s: Scheduler, limit: int = 400) -> Optional[int]:
    """Step until every sequence finished; the steps it took (None: still busy at ``limit``)."""
    for k in range(limit):
        if not s.num_unfinished:
            return k
        run_step(s, finish=True)
    return None


def test_everything_finishes_and_no_block_leaks():
    s, _ = seats_full(a_ahead_by=5000)
    late_b(s)
    assert finish_all(s) is not None
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    s.service.check_invariants()
