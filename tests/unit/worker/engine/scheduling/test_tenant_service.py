"""Fairness by service (VTC): the counters alone, then the scheduler's order with them —
prefix-cache hits are free, and a tenant that arrives or returns from idle starts at the
backlogged tenants' minimum."""

from __future__ import annotations

import pytest

from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from kvfleet.worker.engine.scheduling.tenant_service import DECODE_WEIGHT, PREFILL_WEIGHT, TenantService
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq


def tseq(tenant: str, prompt: list[int], max_tokens: int = 1) -> SequenceState:
    return new_seq(list(prompt), max_tokens=max_tokens, tenant=tenant)


def step_and_finish(s: Scheduler) -> list[SequenceState]:
    """One step; each sequence whose prompt was computed gets its one token and finishes."""
    out = s.schedule()
    s.on_step_done(out)
    done = []
    for x in out.scheduled:
        if x.sample and x.seq.status is SeqStatus.RUNNING:
            x.seq.append_token(7)
            s.finish(x.seq)
            done.append(x.seq)
    s.kv.check_invariants()
    s.service.check_invariants()
    return done


def test_counters_weigh_prefill_and_decode_and_pick_the_least_served():
    ts = TenantService()
    ts.arrive("a")
    ts.arrive("b")
    ts.charge("a", prefill_tokens=10)
    ts.charge("b", decode_tokens=4)
    assert ts.service == {"a": 10 * PREFILL_WEIGHT, "b": 4 * DECODE_WEIGHT}
    assert ts.pick(["a", "b"]) == "b"
    assert ts.pick(["a", "b"], planned={"b": 5.0}) == "a"  # b's turn already taken this step
    assert ts.pick(["b", "a"]) == "b" and ts.pick([]) is None


def test_a_new_or_returning_tenant_starts_at_the_backlogged_minimum():
    ts = TenantService()
    ts.arrive("a", 2)
    ts.arrive("b")
    ts.charge("a", prefill_tokens=100)
    ts.charge("b", prefill_tokens=40)
    ts.arrive("c")  # new: starts at min(100, 40), not at 0
    assert ts.service["c"] == 40
    ts.leave("c")
    ts.charge("a", prefill_tokens=100)
    ts.charge("b", prefill_tokens=100)  # c idle meanwhile: min is now 140
    ts.arrive("c")  # returning: idle time is not banked
    assert ts.service["c"] == 140
    ts.charge("c", prefill_tokens=500)
    ts.leave("c")
    ts.arrive("c")  # returning ahead of the others keeps its own, higher counter
    assert ts.service["c"] == 640
    ts.check_invariants()


def test_a_tenant_back_on_an_idle_replica_starts_at_the_highest_counter():
    ts = TenantService()
    ts.arrive("b")
    ts.charge("b", prefill_tokens=5)
    ts.leave("b")  # b idles while a runs alone
    ts.arrive("a")  # starts at b's 5, the highest yet
    ts.charge("a", prefill_tokens=300)
    ts.leave("a")
    ts.arrive("b")  # nobody backlogged: b has not earned a's 300 by idling
    assert ts.service["b"] == 305
    ts.arrive("a")
    assert ts.pick(["b", "a"]) == "b" and ts.service["a"] == 305


def test_a_returning_tenant_may_start_up_to_its_credit_below_the_floor():
    ts = TenantService(credit=50)
    ts.arrive("a")
    ts.charge("a", prefill_tokens=300)
    ts.arrive("b")  # one credit below a: its first prompts still go before a's next
    assert ts.service["b"] == 250
    ts.charge("b", prefill_tokens=40)  # a first prompt: b is still behind a
    assert ts.pick(["a", "b"]) == "b"
    ts.leave("b")
    ts.charge("a", prefill_tokens=1000)
    ts.arrive("b")  # idle for longer than the credit: banks no more than it
    assert ts.service["b"] == 1250
    ts.arrive("c")  # new: the credit below the backlogged minimum (b's)
    assert ts.service["c"] == 1200
    ts.check_invariants()


def test_a_negative_credit_is_refused():
    with pytest.raises(ValueError, match="credit"):
        TenantService(credit=-1)


def test_idle_tenants_below_the_floor_are_forgotten():
    ts = TenantService()
    for t in ("x", "y"):
        ts.arrive(t)
        ts.leave(t)
    ts.arrive("a")
    ts.charge("a", prefill_tokens=10)
    ts.arrive("b")  # x and y (0, idle) would start at 10 anyway: not kept
    assert set(ts.service) == {"a", "b"}


def test_a_tenant_whose_prompts_hit_the_cache_is_charged_less_and_gets_more_turns():
    # One slot, budget for one 16-token prompt per step: each step admits one request.
    s = make_scheduler(64, max_num_seqs=1, max_num_batched_tokens=16)
    shared = list(range(100, 116))  # cached's prompts all share these 16 tokens
    s.add([tseq("warmer", shared)])  # a third tenant puts them in the prefix cache, then idles
    step_and_finish(s)
    # Interleaved arrivals (arrival_seq follows creation, as the engine numbers them on add).
    fresh = [tseq("fresh", list(range(1000, 1016)))]
    cached = [tseq("cached", shared)]
    fresh += [tseq("fresh", list(range(1000 * i, 1000 * i + 16))) for i in range(2, 7)]
    cached += [tseq("cached", shared) for _ in range(5)]
    s.add(fresh[:1] + cached[:1] + fresh[1:] + cached[1:])
    order = [x.tenant for _ in range(8) for x in step_and_finish(s)]
    # A hit computes 4 of 16 tokens (the last prompt token is always recomputed), so fresh
    # (16 per request) pays 4x what cached pays: cached takes 4 turns per fresh turn, where
    # counting running sequences would alternate (6 and 2 in 8 steps).
    # fresh came first, on the idle replica: one credit (the scheduler's: one step's prefill,
    # 16 here) below warmer's 16 (the highest counter: it ran alone); it paid the credit back
    # when cached arrived, asking for more than its split of the one seat (a flood). cached
    # became backlogged beside that flood and keeps the credit: 16 below it, its 4 turns first.
    assert order == ["cached"] * 4 + ["fresh", "cached", "cached", "fresh"]
    assert s.service.credit == 16 * PREFILL_WEIGHT
    assert s.service.service["cached"] == 16 - s.service.credit + 6 * 4 * PREFILL_WEIGHT
    assert s.service.service["fresh"] == 16 + 2 * 16 * PREFILL_WEIGHT
    assert all(x.num_cached_tokens == 12 for x in cached)


def test_counting_running_sequences_would_alternate_but_service_favours_the_cheap_tenant():
    # Two tenants, one slot: short prompts (4 tokens) vs long ones (16): by count they
    # would alternate; by service the short one gets ~4 turns per long one.
    s = make_scheduler(256, max_num_seqs=1, max_num_batched_tokens=16)
    longs = [tseq("long", list(range(2000 * i, 2000 * i + 16))) for i in range(1, 5)]
    shorts = [tseq("short", list(range(3000 * i, 3000 * i + 4))) for i in range(1, 13)]
    s.add([x for pair in zip(longs, shorts) for x in pair] + shorts[4:])
    order = [x.tenant for _ in range(10) for x in step_and_finish(s)]
    assert order[:2] == ["long", "short"]  # ties go to the oldest waiting
    assert order.count("short") == 8 and order.count("long") == 2


def test_tenant_share_still_caps_and_a_capped_tenant_is_passed_over():
    s = make_scheduler(64, max_num_seqs=4, tenant_share=0.5)
    flood = [tseq("acme", [1, 2, 3, 4], max_tokens=8) for _ in range(6)]
    s.add(flood)
    s.on_step_done(s.schedule())
    assert [x.seq_id for x in s.running] == [f.seq_id for f in flood[:2]]
    late = tseq("globex", [5, 6, 7, 8], max_tokens=8)
    s.add([late])
    s.on_step_done(s.schedule())
    assert late in s.running and len(s.running) == 3  # acme at its share: globex admitted
    s.service.check_invariants()


def test_finish_of_every_sequence_empties_the_backlog():
    s = make_scheduler(64, max_num_seqs=2)
    seqs = [tseq(t, [1, 2, 3, 4, 5], max_tokens=4) for t in ("a", "b", "a")]
    s.add(seqs)
    s.on_step_done(s.schedule())
    for x in seqs:
        s.finish(x)
        s.finish(x)  # idempotent: leaves once
    assert not any(s.service.is_backlogged(t) for t in ("a", "b"))
    s.service.check_invariants()


def test_each_step_charges_prefill_chunks_and_decodes_by_their_weights():
    s = make_scheduler(64, max_num_batched_tokens=4)
    x = tseq("a", list(range(1, 7)), max_tokens=8)
    s.add([x])
    for _ in range(4):  # chunks of 4 and 2 prompt tokens, then two decodes
        out = s.schedule()
        s.on_step_done(out)
        if out.scheduled[0].sample:
            x.append_token(7)
    assert s.service.service["a"] == 6 * PREFILL_WEIGHT + 2 * DECODE_WEIGHT


def test_served_more_is_strict_and_counts_an_unknown_tenant_as_unserved():
    svc = TenantService()
    svc.arrive("a")
    svc.arrive("b")
    svc.charge("a", prefill_tokens=3)
    assert svc.served_more("a", "b") and not svc.served_more("b", "a")
    assert not svc.served_more("a", "a")
    assert svc.served_more("a", "never-seen") and not svc.served_more("never-seen", "b")
    svc.charge("b", prefill_tokens=3)
    assert not svc.served_more("a", "b") and not svc.served_more("b", "a")  # a tie: neither
    assert svc.behind("b", ["a", "b"]) is False
