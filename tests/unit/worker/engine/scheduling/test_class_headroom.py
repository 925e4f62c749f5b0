"""Class headroom (worker/engine/scheduling/priority_queue.py, "Headroom"): beside a lower class
a better one runs in up to ``class_headroom`` seats past ``max_num_seqs``, and those seats never
count against the lower class, so the lower class keeps its rows in every step (real KV cache
manager, a fixed linear cost model under an ITL target, no model, no clock)."""

from __future__ import annotations

import pytest

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.worker.engine.layer_yield.nested import nested_step
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.priority_queue import PriorityRules, default_headroom
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.worker.step_cost.model import CostModel
from tests.unit.worker.scheduler_harness import new_seq, run_step

# A step: 10 ms, + 4 ms a decode row, + 1 ms a prefill token; the target leaves room for every
# test's decode rows and first chunks, so only seats decide who runs.
COST = CostModel(step_base_s=0.010, prefill_token_s=0.001, decode_token_s=0.004)


def make(headroom: int | None = 1, seats: int = 4, **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": seats, "max_num_batched_tokens": 64,
                                "itl_target_ms": 500, "class_headroom": headroom, **cfg})
    return Scheduler(config, KVCacheManager(96, 16), COST)


def seq(level: int, max_tokens: int = 4) -> SequenceState:
    return new_seq(prompt_len=8, max_tokens=max_tokens, priority=level)


def flood(s: Scheduler, n: int, max_tokens: int = 4) -> list[SequenceState]:
    """``n`` batch sequences, prefilled (each streamed its first token)."""
    rows = [seq(BATCH, max_tokens) for _ in range(n)]
    s.add(rows)
    run_step(s)
    assert all(r.status is SeqStatus.RUNNING for r in rows)
    return rows


def ids(out: SchedulerOutput) -> set[str]:
    return {x.seq.seq_id for x in out.scheduled}


@pytest.mark.parametrize(("held", "priority", "free"), [
    ({}, BATCH, 4),
    ({BATCH: 4}, BATCH, 0),               # one class alone: max_num_seqs, as before
    ({BATCH: 4}, INTERACTIVE, 1),         # a better class: one seat on top
    ({BATCH: 4, INTERACTIVE: 1}, INTERACTIVE, 0),
    ({BATCH: 3, INTERACTIVE: 1}, BATCH, 1),  # the seat on top does not count against batch
    ({BATCH: 4, INTERACTIVE: 1}, BATCH, 0),
    ({BATCH: 2, INTERACTIVE: 3}, BATCH, 0),  # better seats past the headroom do count
    ({BATCH: 4, INTERACTIVE: 1}, DEFAULT, 0),  # never past max_num_seqs + headroom in all
    ({INTERACTIVE: 4}, INTERACTIVE, 0),
])
def test_free_seats(held, priority, free):
    assert PriorityRules(4, headroom=1).free_seats(priority, held) == free


def test_seats_over_and_the_default():
    rules = PriorityRules(4, headroom=1)
    assert rules.seats_over({BATCH: 4, INTERACTIVE: 1}) == 0
    assert rules.seats_over({BATCH: 4, INTERACTIVE: 2}) == 1  # a borrowed seat: one to return
    assert rules.seats_over({INTERACTIVE: 5}) == 1  # one class alone: max_num_seqs
    assert rules.seats_over({}) == 0
    assert PriorityRules(4, headroom=0).seats_over({BATCH: 4, INTERACTIVE: 1}) == 1
    assert [default_headroom(n) for n in (1, 8, 16, 17, 256)] == [1, 1, 2, 2, 32]
    assert PriorityRules(16).headroom == 2
    with pytest.raises(ValueError, match="class_headroom"):
        SchedulerConfig(class_headroom=-1)


def test_an_interactive_prompt_rides_on_top_of_the_full_flood():
    s = make()
    rows = flood(s, 4)
    s.add([seq(BATCH)])  # the flood's next prompt waits for a seat
    i1 = seq(INTERACTIVE)
    s.add([i1])
    out = run_step(s)  # i1's prompt (class_step may sit batch rows out of this one step)
    assert not out.preempted and i1.seq_id in ids(out)
    assert all(r.status is SeqStatus.RUNNING for r in rows)  # no batch row gave its seat up
    assert len(s.running) == 5
    out = run_step(s)
    assert ids(out) == {r.seq_id for r in rows} | {i1.seq_id}  # every row decodes on


def test_without_headroom_the_prompt_takes_a_batch_seat():
    s = make(headroom=0)
    rows = flood(s, 4)
    i1 = seq(INTERACTIVE)
    s.add([i1])
    out = run_step(s)
    assert list(out.preempted) == [rows[-1]]  # the newest batch row, as before
    assert len(s.running) == 4 and i1.status is SeqStatus.RUNNING


def test_a_finished_batch_row_gives_its_seat_to_batch_not_to_the_headroom():
    s = make()
    rows = flood(s, 4, max_tokens=2)
    i1 = seq(INTERACTIVE, max_tokens=16)
    nxt = [seq(BATCH) for _ in range(4)]
    s.add([i1, *nxt])
    for _ in range(4):  # i1 on top; the flood's rows finish
        run_step(s, finish=True)
    assert all(r.status is SeqStatus.FINISHED for r in rows)
    assert i1.status is SeqStatus.RUNNING
    assert {r.seq_id for r in s.running} == {i1.seq_id} | {b.seq_id for b in nxt}


def test_past_the_headroom_a_better_class_preempts_as_before():
    s = make()
    rows = flood(s, 4)
    i1, i2 = seq(INTERACTIVE), seq(INTERACTIVE)
    s.add([i1, i2])
    out = run_step(s)
    assert list(out.preempted) == [rows[-1]]  # i1 on top, i2 in the newest batch row's seat
    assert {i1.seq_id, i2.seq_id} <= ids(out) and len(s.running) == 5


def test_one_class_alone_never_passes_max_num_seqs():
    for level in (INTERACTIVE, BATCH):
        s = make()
        many = [seq(level) for _ in range(6)]
        s.add(many)
        out = run_step(s)
        assert len(out.scheduled) == 4 and len(s.running) == 4


def test_a_nested_step_takes_the_headroom_seat_and_nothing_is_preempted_after():
    s = make(layer_yield="on")
    rows = flood(s, 4)
    paused = s.schedule()  # the flood's decode step, in flight
    i1 = seq(INTERACTIVE)
    s.add([i1])
    nested = nested_step(s, paused, 0.0)
    assert ids(nested) == {i1.seq_id} and len(s.running) == 5
    for out in (nested, paused):
        s.on_step_done(out)
        for x in out.scheduled:
            x.seq.append_token(7)
    out = run_step(s)
    assert not out.preempted and ids(out) == {r.seq_id for r in rows} | {i1.seq_id}


def test_everything_finishes_and_no_block_leaks():
    s = make(layer_yield="on")
    reqs = [seq(BATCH, max_tokens=3) for _ in range(7)] + [seq(INTERACTIVE, max_tokens=3)
                                                           for _ in range(3)]
    s.add(reqs[:5])
    run_step(s, finish=True)
    s.add(reqs[5:])
    for _ in range(40):
        if not s.num_unfinished:
            break
        assert len(s.running) <= 5
        run_step(s, finish=True)
    assert all(r.status is SeqStatus.FINISHED for r in reqs)
    assert s.kv.num_free_blocks == 96


def test_no_lower_prompt_joins_a_whole_step_beside_a_better_prompt():
    # Without an ITL target (no class_step) batch prompts would fill i1's step to the token
    # budget; they take the next step instead.
    s = make(itl_target_ms=None, max_num_batched_tokens=512)
    rows = flood(s, 2, max_tokens=8)
    i1 = seq(INTERACTIVE)
    more = [seq(BATCH) for _ in range(2)]
    s.add([i1, *more])
    out = run_step(s)
    assert ids(out) == {r.seq_id for r in rows} | {i1.seq_id}
    assert all(m.status is SeqStatus.WAITING for m in more)
    out = run_step(s)
    assert {m.seq_id for m in more} <= ids(out)  # the next step, whole: 2 + 1 on top + 2
    assert len(s.running) == 5
