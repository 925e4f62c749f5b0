"""The service credit is a light tenant's (``TenantService``, VTC-style lift): a tenant that
becomes backlogged below a flood keeps it; one lent it below a light tenant — a flood starting
beside a tenant that just ran alone — pays it back once it floods, so it is not the less-served
of the two (no model, no clock)."""

from __future__ import annotations

from kvfleet.worker.engine.scheduling.tenant_service import TenantService
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq, run_step

CREDIT = 50.0


def test_a_flood_starting_beside_a_tenant_that_ran_alone_starts_at_its_counter():
    ts = TenantService(credit=CREDIT, seats=4)
    ts.arrive("b")
    ts.charge("b", prefill_tokens=300)
    ts.leave("b")  # b ran alone, then idles: the highest counter
    ts.arrive("a")  # one sequence, within its split: lent the credit below b
    assert ts.service["a"] == 300 - CREDIT
    ts.arrive("a", 4)  # 5 of 4 seats: a floods and pays it back
    assert ts.service["a"] == 300
    ts.arrive("b")  # b comes back beside the flood: its credit is its own
    assert ts.service["b"] == 300 and ts.pick(["a", "b"]) == "a"  # a tie: no credit below b
    ts.charge("a", prefill_tokens=10)
    assert ts.served_more("a", "b")  # one chunk of the flood and it is the over-served
    ts.check_invariants()


def test_a_flood_joining_a_backlogged_light_tenant_pays_the_credit_back():
    ts = TenantService(credit=CREDIT, seats=4)
    ts.arrive("b")
    ts.charge("b", prefill_tokens=300)  # b still running one sequence
    ts.arrive("a", 2)  # 2 of a split of 2: light, lent the credit below b
    assert ts.service["a"] == 300 - CREDIT
    ts.charge("a", prefill_tokens=20)
    ts.arrive("a")  # 3 past its split: floods, pays the rest back, keeps what it was served
    assert ts.service["a"] == 300 + 20
    ts.check_invariants()


def test_a_light_tenant_returning_beside_a_flood_keeps_its_credit_even_bursting():
    ts = TenantService(credit=CREDIT, seats=4)
    ts.arrive("a", 6)
    ts.charge("a", prefill_tokens=1000)
    ts.arrive("b")  # beside a flood: the credit below it is b's to keep
    assert ts.service["b"] == 1000 - CREDIT and ts.pick(["a", "b"]) == "b"
    ts.arrive("b", 2)  # a burst past its split of 2
    assert ts.service["b"] == 1000 - CREDIT
    ts.leave("b", 3)
    ts.charge("a", prefill_tokens=500)
    ts.arrive("b")  # back from idle: at most the credit banked, as before
    assert ts.service["b"] == 1500 - CREDIT
    ts.check_invariants()


def test_two_light_tenants_lend_each_other_the_credit():
    ts = TenantService(credit=CREDIT, seats=4)
    ts.arrive("a")
    ts.charge("a", prefill_tokens=300)
    ts.arrive("b")  # neither asks past its split: b keeps the credit while it stays light
    ts.charge("b", prefill_tokens=40)
    assert ts.service["b"] == 300 - CREDIT + 40 and ts.pick(["a", "b"]) == "b"
    ts.leave("b")
    assert ts.service["b"] == 290  # it never flooded: nothing to pay back
    ts.check_invariants()


def test_without_seats_the_credit_is_always_kept():
    ts = TenantService(credit=CREDIT)
    ts.arrive("b")
    ts.charge("b", prefill_tokens=300)
    ts.arrive("a", 100)
    assert ts.service["a"] == 300 - CREDIT


def test_the_light_tenants_prompt_goes_first_at_the_floods_start():
    # 8 seats, a step of 32 tokens (the credit): b runs alone and keeps one row decoding; then
    # a's flood (6 prompts, past its split of 4) and one more b prompt arrive.
    s = make_scheduler(256, max_num_seqs=8, max_num_batched_tokens=32, tenant_share=0.5)
    b_row = new_seq(prompt_len=16, max_tokens=40, tenant="b")
    s.add([b_row])
    for _ in range(4):
        run_step(s)
    flood = [new_seq(prompt_len=32, max_tokens=4, tenant="a") for _ in range(6)]
    b_new = new_seq(prompt_len=16, max_tokens=4, tenant="b")
    s.add([*flood, b_new])
    assert s.service.service["a"] >= s.service.service["b"]  # not the credit below b
    first = run_step(s)
    assert b_new in [x.seq for x in first.scheduled]  # b's prompt is not held behind a's
    run_step(s)
    assert s.service.served_more("a", "b")  # the flood is the over-served from its second step
    s.service.check_invariants()
    s.kv.check_invariants()
