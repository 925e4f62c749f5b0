"""Layer-level yield between tenants of one class (``tenant_share`` < 1) and the whole step's
hold-back without an ITL target: a less-served tenant's prompt overtakes a flood's prefill
(worker/engine/layer_yield/nested.py, worker/engine/scheduling/scheduler.py; real KV cache
manager, no model, no clock)."""

from __future__ import annotations

from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.worker.engine.layer_yield.nested import may_yield, nested_step, yields_to
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq


def seq(tenant: str, prompt_len: int = 8, priority: int = DEFAULT) -> SequenceState:
    return new_seq(prompt_len=prompt_len, max_tokens=4, tenant=tenant, priority=priority)


def finish_step(s: Scheduler, out: SchedulerOutput) -> None:
    """Complete a planned step as the engine does: count it computed, sample its rows."""
    s.on_step_done(out)
    for x in out.scheduled:
        if x.sample and x.seq.status is SeqStatus.RUNNING:
            x.seq.append_token(7)


def flood_in_flight(share: float = 0.5) -> tuple[Scheduler, list[SequenceState], SchedulerOutput]:
    """Tenant A's two prompts streamed once, then A's two more prompts planned beside their
    decode rows (the step in flight)."""
    s = make_scheduler(64, max_num_seqs=8, max_num_batched_tokens=64, tenant_share=share)
    first = [seq("A"), seq("A")]
    s.add(first)
    finish_step(s, s.schedule())
    more = [seq("A"), seq("A")]
    s.add(more)
    out = s.schedule()
    assert {x.seq.seq_id for x in out.scheduled} == {r.seq_id for r in first + more}
    return s, first + more, out


def test_a_flood_step_yields_to_a_tenant_served_less_and_to_no_one_else():
    s, _, out = flood_in_flight()
    served = s.service.service
    assert served["A"] > 0
    assert yields_to(out, DEFAULT, "B", {"A": 10.0, "B": 9.0})
    assert not yields_to(out, DEFAULT, "B", {"A": 10.0, "B": 10.0})  # equals never pause
    assert not yields_to(out, DEFAULT, "B", {"A": 10.0, "B": 11.0})  # B served more
    assert not yields_to(out, DEFAULT, "A", {"A": 0.0})  # never to the tenant's own prompt
    assert not yields_to(out, DEFAULT)  # by class alone: A's unstreamed prompts are its own class
    assert not yields_to(out, BATCH, "B", {"B": 0.0})  # a better class in it


def test_a_step_with_the_tenants_own_prompt_or_a_less_served_tenants_does_not_yield():
    s = make_scheduler(64, max_num_seqs=8)  # no share: nothing held back, one step of both
    a, b = seq("A"), seq("B")
    s.add([a, b])
    out = s.schedule()  # both prompts, neither streamed
    assert len(out.scheduled) == 2
    assert not yields_to(out, DEFAULT, "B", {"A": 5.0, "B": 1.0})  # B's own prompt in it
    assert not yields_to(out, DEFAULT, "C", {"A": 5.0, "B": 1.0, "C": 3.0})  # B's is served less
    assert yields_to(out, DEFAULT, "C", {"A": 5.0, "B": 3.0, "C": 1.0})
    assert not yields_to(out, BATCH, "C", {"A": 5.0, "B": 3.0, "C": 1.0})  # better rows in it
    finish_step(s, out)


def test_the_nested_step_takes_the_less_served_tenants_prompts_only_on_free_blocks():
    s, rows, paused = flood_in_flight()
    tables = {r.seq_id: list(s.kv.block_table(r.seq_id)) for r in rows}
    computed = {r.seq_id: r.num_computed_tokens for r in rows}
    a_late, b1, b2 = seq("A"), seq("B"), seq("B", prompt_len=12)
    s.add([a_late, b1, b2])  # A's queued first: B's are admitted by service
    assert may_yield(s, paused)
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [b1, b2]
    assert [x.num_new_tokens for x in nested.scheduled] == [8, 12]
    assert a_late.status is SeqStatus.WAITING and not nested.preempted
    assert {r.seq_id: list(s.kv.block_table(r.seq_id)) for r in rows} == tables
    assert {r.seq_id: r.num_computed_tokens for r in rows} == computed
    nested_blocks = {b for x in nested.scheduled for b in s.kv.block_table(x.seq.seq_id)}
    assert not nested_blocks & {b for t in tables.values() for b in t}
    finish_step(s, nested)
    finish_step(s, paused)
    assert b1.output_token_ids == [7] and rows[0].output_token_ids == [7, 7]
    for r in [*rows, a_late, b1, b2]:
        s.finish(r)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    s.kv.check_invariants()


def test_without_a_tenant_share_tenants_never_yield_to_each_other():
    s, rows, paused = flood_in_flight(share=1.0)
    s.add([seq("B")])
    assert not s.competing and not may_yield(s, paused)
    assert not nested_step(s, paused, 0.0).scheduled
    finish_step(s, paused)


def test_competing_counts_tenants_only_where_seats_are_divided():
    shared = make_scheduler(64, tenant_share=0.5)
    shared.add([seq("A"), seq("A")])
    assert not shared.competing
    shared.add([seq("B")])
    assert shared.competing
    plain = make_scheduler(64)
    plain.add([seq("A"), seq("B")])
    assert not plain.competing
    plain.add([seq("A", priority=INTERACTIVE)])
    assert plain.competing


def test_without_an_itl_target_a_less_served_tenants_prompt_runs_without_the_floods():
    """The whole step: B's prompt admitted first (least served) keeps A's waiting prompts out;
    A's own prompts fill a step of their own; with no tenant share nothing is held back."""
    for share, expect_a in ((0.5, 0), (1.0, 2)):
        s = make_scheduler(64, max_num_seqs=8, max_num_batched_tokens=64, tenant_share=share)
        a0 = seq("A")
        s.add([a0])
        finish_step(s, s.schedule())  # A served, streaming
        b, a1, a2 = seq("B"), seq("A"), seq("A")
        s.add([a1, a2, b])
        out = s.schedule()
        new = [x.seq for x in out.scheduled if x.seq is not a0]
        assert new[0] is b and sum(x.tenant == "A" for x in new) == expect_a
        assert a0 in [x.seq for x in out.scheduled]  # the running decode row still runs
        finish_step(s, out)
        if share < 1:  # the next step: A's prompts together, B's decode row beside them
            nxt = [x.seq for x in s.schedule().scheduled]
            assert a1 in nxt and a2 in nxt and b in nxt


def test_without_an_itl_target_equally_served_tenants_share_a_step():
    s = make_scheduler(64, max_num_seqs=8, max_num_batched_tokens=64, tenant_share=0.5)
    both = [seq("A"), seq("B"), seq("A"), seq("B")]
    s.add(both)
    assert {x.seq.seq_id for x in s.schedule().scheduled} == {x.seq_id for x in both}


def test_with_every_seat_taken_the_nested_step_borrows_one_from_a_more_served_tenant():
    """Seats full (two tenants at their share): the less-served tenant's prompt borrows one
    seat past ``max_num_seqs``, no more; nothing is preempted for it, and nothing more is
    admitted until a finish gives the seat back."""
    s = make_scheduler(64, max_num_seqs=4, max_num_batched_tokens=64, tenant_share=0.5)
    rows = [seq("A"), seq("A"), seq("B"), seq("B")]
    s.add(rows)
    finish_step(s, s.schedule())  # equally served: all four in one step
    # A served more, within the service credit: the borrowed seat, no seat preempted for B
    s.service.charge("A", prefill_tokens=s.service.credit - 14)
    paused = s.schedule()  # four decode rows, every seat taken
    assert len(paused.scheduled) == 4
    a3, b3, b4 = seq("A"), seq("B"), seq("B")
    s.add([a3, b3, b4])  # B may run past its share while A, served more, waits
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [b3] and not nested.preempted
    finish_step(s, nested)
    finish_step(s, paused)
    out = s.schedule()
    assert not out.preempted and len(s.running) == 5
    assert b4.status is SeqStatus.WAITING and a3.status is SeqStatus.WAITING
    finish_step(s, out)
    for r in [*rows, a3, b3, b4]:
        s.finish(r)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    s.kv.check_invariants()


def test_under_reserve_the_nested_step_borrows_no_seat():
    s = make_scheduler(64, max_num_seqs=4, max_num_batched_tokens=64, tenant_share=0.5,
                       policy="reserve")
    s.add([seq("A"), seq("A"), seq("B"), seq("B")])
    finish_step(s, s.schedule())
    s.service.charge("A", prefill_tokens=100)
    paused = s.schedule()
    s.add([seq("A"), seq("B")])
    assert not nested_step(s, paused, 0.0).scheduled
