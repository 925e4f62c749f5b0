"""Running seats lent by service (``seats_by_service``, the default with ``tenant_share`` < 1):
a tenant behind a waiting tenant runs past its share; one ahead, or beside a tenant that
waits for nothing, keeps to it."""

from __future__ import annotations

import pytest

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from tests.unit.worker.scheduler_harness import held, make_scheduler, new_seq, run_step


def two_tenants(lend: bool, waiting_b: int) -> tuple[Scheduler, list[SequenceState]]:
    """4 seats, share 0.5: tenants a and b each run 2 long sequences; a has 3 more waiting,
    b ``waiting_b``; b has been served more. Returns the scheduler and b's running ones."""
    s = make_scheduler(256, max_num_seqs=4, tenant_share=0.5, seats_by_service=lend)
    a = [new_seq(prompt_len=4, max_tokens=50, tenant="a") for _ in range(5)]
    b = [new_seq(prompt_len=4, max_tokens=50, tenant="b") for _ in range(2 + waiting_b)]
    s.add([x for pair in zip(a, b) for x in pair] + a[len(b):] + b[len(a):])
    run_step(s)
    assert held(s, "a") == held(s, "b") == 2
    s.service.charge("b", prefill_tokens=1000)  # b ahead of a
    return s, [x for x in b if x in s.running]


@pytest.mark.parametrize("lend", [True, False])
def test_a_tenant_behind_a_waiting_tenant_takes_a_freed_seat_past_its_share(lend):
    s, b_running = two_tenants(lend, waiting_b=2)
    s.finish(b_running[0])
    run_step(s)
    # lent: a (least served, b waiting) takes the seat; fixed: a is at its share, b takes it
    assert (held(s, "a"), held(s, "b")) == ((3, 1) if lend else (2, 2))
    s.service.check_invariants()


def test_seats_follow_whichever_tenant_is_behind():
    s, _ = two_tenants(True, waiting_b=2)
    s.service.charge("a", prefill_tokens=5000)  # now a is ahead of b
    s.finish([x for x in s.running if x.tenant == "a"][0])
    run_step(s)
    assert (held(s, "a"), held(s, "b")) == (1, 3)  # b behind a waiting a: b lent a seat
    s.service.charge("b", prefill_tokens=5000)  # b ahead again
    s.finish([x for x in s.running if x.tenant == "b"][0])
    run_step(s)
    assert (held(s, "a"), held(s, "b")) == (2, 2)


def test_a_tenant_ahead_that_waits_for_nothing_keeps_the_rest_of_its_share_free():
    s, b_running = two_tenants(True, waiting_b=0)
    s.finish(b_running[0])
    for _ in range(3):
        run_step(s)
    assert (held(s, "a"), held(s, "b")) == (2, 1)  # a behind b, but b waits for nothing
    s.service.charge("a", prefill_tokens=2000)  # a's own work puts it ahead meanwhile
    late = new_seq(prompt_len=4, max_tokens=50, tenant="b")
    s.add([late])
    out = run_step(s)
    assert late in s.running and not out.preempted  # b's next arrival found its seat free
