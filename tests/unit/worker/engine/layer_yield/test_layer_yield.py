"""The scheduler's side of layer-level yield (worker/engine/layer_yield/nested.py): which steps yield
to which class, and the nested step planned while a step is paused (real KV cache manager,
no model)."""

from __future__ import annotations

from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.worker.engine.layer_yield.nested import nested_step, yields_to
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from kvfleet.worker.kv_tier.admission import TierAdmission
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq, run_step


def seq(level: int, prompt_len: int = 8, max_tokens: int = 4) -> SequenceState:
    return new_seq(prompt_len=prompt_len, max_tokens=max_tokens, priority=level)


def finish_step(s: Scheduler, out: SchedulerOutput) -> None:
    """Complete a planned step as the engine does: count it computed, sample its rows."""
    s.on_step_done(out)
    for x in out.scheduled:
        if x.sample and x.seq.status is SeqStatus.RUNNING:
            x.seq.append_token(7)


def batch_in_flight(s: Scheduler, n: int, prompt_len: int = 8) -> tuple[list[SequenceState],
                                                                         SchedulerOutput]:
    """``n`` batch sequences, streamed once, then a step of them planned (in flight)."""
    rows = [seq(BATCH, prompt_len) for _ in range(n)]
    s.add(rows)
    run_step(s)  # their prompts: each samples its first token
    return rows, s.schedule()


def test_a_step_yields_only_to_a_class_it_holds_lower_rows_of_and_no_unstreamed_equal():
    s = make_scheduler(64, max_num_seqs=4)
    rows, out = batch_in_flight(s, 2)
    assert yields_to(out, INTERACTIVE) and yields_to(out, DEFAULT)
    assert not yields_to(out, BATCH)  # nothing lower in it
    assert not yields_to(SchedulerOutput(out.plan, ()), INTERACTIVE)  # an empty step
    finish_step(s, out)
    i_prompt = seq(INTERACTIVE)
    s.add([i_prompt])
    out = s.schedule()  # an interactive prompt (not streamed) beside the batch rows
    assert not yields_to(out, INTERACTIVE)  # an older same-class prompt is never overtaken
    assert not yields_to(out, DEFAULT)  # a better class in it
    finish_step(s, out)
    out = s.schedule()  # now the interactive row decodes (streamed) beside batch rows
    assert i_prompt.output_token_ids and yields_to(out, INTERACTIVE)


def test_batch_prompts_in_flight_yield_too():
    s = make_scheduler(64, max_num_seqs=4)
    s.add([seq(BATCH), seq(BATCH)])
    assert yields_to(s.schedule(), INTERACTIVE)


def test_the_nested_step_holds_only_better_waiting_sequences_on_disjoint_free_blocks():
    s = make_scheduler(64, max_num_seqs=4, max_num_batched_tokens=64)
    rows, paused = batch_in_flight(s, 2)
    tables = {x.seq.seq_id: list(s.kv.block_table(x.seq.seq_id)) for x in paused.scheduled}
    late_batch, i1, d1 = seq(BATCH), seq(INTERACTIVE), seq(DEFAULT, prompt_len=12)
    s.add([late_batch, i1, d1])
    free_before = s.kv.num_free_blocks
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [i1, d1]  # queue order; never late_batch
    assert [x.num_new_tokens for x in nested.scheduled] == [8, 12]
    assert all(x.sample for x in nested.scheduled)
    assert not {x.seq.seq_id for x in nested.scheduled} & set(tables)
    # The paused rows untouched: same tables, same counters, still running; nothing preempted.
    assert {sid: list(s.kv.block_table(sid)) for sid in tables} == tables
    assert all(r.status is SeqStatus.RUNNING and r.num_computed_tokens == 8 for r in rows)
    assert not nested.preempted and late_batch.status is SeqStatus.WAITING
    nested_blocks = {b for x in nested.scheduled for b in s.kv.block_table(x.seq.seq_id)}
    assert not nested_blocks & {b for t in tables.values() for b in t}
    assert s.kv.num_free_blocks == free_before - 5  # 2 + 3 fresh blocks of 4 tokens
    # Both steps finish in either order; nothing leaks once every sequence has ended.
    finish_step(s, nested)
    finish_step(s, paused)
    assert i1.output_token_ids == [7] and rows[0].output_token_ids == [7, 7]
    s.kv.check_invariants()
    for r in [*rows, late_batch, i1, d1]:
        s.finish(r)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    s.kv.check_invariants()


def test_no_yield_when_blocks_are_short_and_nothing_changes():
    s = make_scheduler(7, max_num_seqs=4)  # 2 rows × 3 blocks after their step: 1 left
    rows, paused = batch_in_flight(s, 2)
    i1 = seq(INTERACTIVE, prompt_len=12)  # needs 3 blocks
    s.add([i1])
    free, running = s.kv.num_free_blocks, list(s.running)
    nested = nested_step(s, paused, 0.0)
    assert not nested.scheduled and not nested.plan.chunks
    assert s.kv.num_free_blocks == free and s.running == running
    assert i1.status is SeqStatus.WAITING and list(s.waiting) == [i1]
    finish_step(s, paused)
    s.kv.check_invariants()


def test_nothing_better_waiting_means_no_nested_step():
    s = make_scheduler(64, max_num_seqs=4)
    _, paused = batch_in_flight(s, 2)
    s.add([seq(BATCH)])
    assert not nested_step(s, paused, 0.0).scheduled
    i1 = seq(INTERACTIVE)
    s.add([i1])
    assert [x.seq for x in nested_step(s, paused, 0.0).scheduled] == [i1]


def test_beside_a_host_tier_the_nested_plan_lists_the_cached_blocks_it_evicts():
    """Every free block is a cached one: the nested allocation evicts some, and its plan
    lists them for write-back (never a block of the paused step)."""
    s = make_scheduler(8, max_num_seqs=4)
    s.tier = TierAdmission(s.kv, TierLookup(HostTierStore(1 << 20)))
    first = seq(DEFAULT, prompt_len=17)
    s.add([first])
    run_step(s)
    s.finish(first)  # its 4 full blocks stay cached, unreferenced
    assert s.kv.num_free_blocks == 8
    _, paused = batch_in_flight(s, 2, prompt_len=4)  # 2 blocks each, both kept for decode
    i1 = seq(INTERACTIVE, prompt_len=12)
    s.add([i1])
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [i1]
    saved = {b for b, _ in nested.plan.block_saves}
    assert saved and saved <= set(s.kv.block_table(i1.seq_id))
    assert not saved & {b for x in paused.scheduled for b in s.kv.block_table(x.seq.seq_id)}
    finish_step(s, nested)
    finish_step(s, paused)
    s.kv.check_invariants()


def test_a_borrowed_seat_goes_back_by_preemption_at_the_next_step():
    s = make_scheduler(64, max_num_seqs=2, class_headroom=0)
    rows, paused = batch_in_flight(s, 2)
    i1 = seq(INTERACTIVE)
    s.add([i1])
    nested = nested_step(s, paused, 0.0)  # every seat taken: borrowed from a batch row
    assert [x.seq for x in nested.scheduled] == [i1] and len(s.running) == 3
    finish_step(s, nested)
    finish_step(s, paused)
    out = s.schedule()
    assert list(out.preempted) == [rows[1]]  # the newest of the lower class
    assert len(s.running) == 2 and rows[1].status is SeqStatus.WAITING
    s.kv.check_invariants()


def test_no_seat_to_borrow_means_no_nested_step():
    # Reserve never preempts: no seat to borrow.
    for cfg in ({"policy": "reserve"},):
        s = make_scheduler(64, max_num_seqs=2, class_headroom=0, **cfg)
        _, paused = batch_in_flight(s, 2)
        i1 = seq(INTERACTIVE)
        s.add([i1])
        assert not nested_step(s, paused, 0.0).scheduled, cfg
        assert i1.status is SeqStatus.WAITING and len(s.running) == 2
