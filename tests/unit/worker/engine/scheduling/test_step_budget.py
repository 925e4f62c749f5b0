"""The ITL target's step budget with a fake (fixed, known) cost model and a fake clock: a step
never predicts past the target except by its floor, a waiting prefill always advances and
reaches its first token within the stretch of its time without the target, a chunk is never
stretched where it saves no step, and chunks that stop short end on block boundaries."""

from __future__ import annotations

import copy
import random

import pytest

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.prefill_pace import (
    CATCH_UP_STRETCH,
    TTFT_STRETCH,
    PrefillPace,
    paced_prefill,
)
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.engine.scheduling.step_budget import StepBudget, step_budget
from kvfleet.worker.step_cost.model import CostModel, attended, plan_shape

BS = 4
# 1 ms a step, 0.1 ms per prefill token, 0.5 ms per decode row, 1 µs per attended position.
COST = CostModel(0.001, 0.0001, 0.0005, "fake", 1e-6)
TARGET_MS = 5.0
_arrival = iter(range(10**6))


def make(n_blocks: int = 400, target_ms: float | None = TARGET_MS, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 512)
    return Scheduler(SchedulerConfig(itl_target_ms=target_ms, **cfg), KVCacheManager(n_blocks, BS), COST)


def seq(prompt_len: int, max_tokens: int = 8, arrival: float = 0.0) -> SequenceState:
    a = next(_arrival)
    s = SequenceState(seq_id=f"s{a}", request_id=f"s{a}", index=0,
                      prompt_token_ids=[1 + (a * 7 + i) % 900 for i in range(prompt_len)],
                      params=SamplingParams(max_tokens=max_tokens), root_hash=b"r" * 16,
                      block_size=BS, arrival_seq=a)
    s.timing.arrival = arrival
    return s


def step(s: Scheduler, now: float):
    out = s.schedule(now)
    s.on_step_done(out)
    for x in out.scheduled:
        if x.sample and x.seq.status is SeqStatus.RUNNING:
            x.seq.append_token(7)
            if len(x.seq.output_token_ids) >= x.seq.params.max_tokens:
                s.finish(x.seq)
    s.kv.check_invariants()
    return out


def floor_now(s: Scheduler, now: float) -> int:
    """The floor the scheduler's next step at ``now`` will have (its pacer copied, so the
    step itself starts from the same state)."""
    head = s.waiting[0] if s.waiting else None
    return step_budget(s.config, BS, COST, s.running, head, frozenset(), now,
                       copy.deepcopy(s.pace)).floor_left


def test_the_floor_is_the_smallest_chunk_whose_steps_end_the_prompt_in_time():
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    b.reserve_decodes([40] * 6)
    left = 0.06
    f = b.pace(0, 400, left)
    assert f % BS == 0 and b.floor_left == f

    def steps_s(n: int) -> float:  # ceil(400 / n) steps: the full ones as this one with n
        full = -(-400 // n) - 1
        last = 400 - full * n
        return full * COST.predict_step_s(6, n, 6 * 41 + n) + COST.predict_step_s(
            6, last, 6 * 41 + full * n + last)
    assert steps_s(f) <= left
    assert steps_s(f - BS) > left  # a block less would be late
    # More time, a smaller floor; late (even one step is too long): all that is left.
    assert b.pace(0, 400, 2 * left) < f
    assert b.pace(0, 400, 0.001) == 400 and b.pace(0, 600, -1.0) == 512  # within the tokens
    assert b.pace(0, 1, 0.0) == 512 and StepBudget(8, BS).pace(0, 9, 0.0) == 0  # kept; untimed
    with pytest.raises(ValueError, match="remaining"):
        b.pace(0, -1, 1.0)


def test_the_untargeted_time_is_token_budget_chunks_beside_the_rows():
    b = StepBudget(100, BS, COST, TARGET_MS / 1e3)
    b.reserve_decodes([9] * 4)
    rows = (4, 4 * 10)
    expect = (COST.predict_step_s(4, 96, rows[1] + 96) + COST.predict_step_s(4, 96, rows[1] + 192)
              + COST.predict_step_s(4, 58, rows[1] + 250))
    assert b.untargeted_s(0, 250) == pytest.approx(expect)


def test_a_chunk_that_saves_no_step_is_not_stretched_to_the_target():
    """80 tokens where the target allows 36 a step: 3 steps either way, so 28 (27 rounded up
    to a block) rather than 36, 36, 8; a prompt that fits is run whole."""
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    fits = 36
    target = TARGET_MS / 1e3
    assert COST.predict_step_s(0, fits, fits) <= target < COST.predict_step_s(0, fits + BS, fits + BS)
    assert b.grant(0, 80) == 28
    assert b.grant(0, 72) == 36  # two full steps: nothing to trim
    assert b.grant(0, 30) == 30
    # Without a target nothing is trimmed: the token budget.
    assert StepBudget(512, BS).grant(0, 100) == 100


def test_a_lone_prompt_behind_its_pace_gets_the_catch_up_stretch_once():
    """A running prompt paced alone with less left than CATCH_UP_STRETCH × its remaining
    untargeted time has its deadline moved, once, to that much from now (so its floor spreads
    over a few steps, not all at once); paced with others, or a second time, it is not moved."""
    s = make()
    a = seq(200, arrival=5.0)
    s.add([a])
    step(s, 5.0)
    assert a.status is SeqStatus.RUNNING and 0 < a.num_computed_tokens < 200
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    b.reserve_decodes([])
    remaining = a.num_tokens - a.num_computed_tokens
    catch_up = CATCH_UP_STRETCH * b.untargeted_s(a.num_computed_tokens, remaining)
    pace, other = PrefillPace(), PrefillPace()
    deadline = 5.0 + pace.left_s(a, b, 5.0)
    late = deadline + 0.01
    assert other.left_s(a, b, 5.0) == pytest.approx(deadline - 5.0)
    assert other.left_s(a, b, late) == pytest.approx(-0.01)  # with a queue: late, all at once
    assert pace.left_s(a, b, late, alone=True) == pytest.approx(catch_up)
    assert b.pace(a.num_computed_tokens, remaining, catch_up) < remaining  # spread over steps
    assert b.pace(a.num_computed_tokens, remaining, -0.01) == remaining
    # once: later it is late again, and the old rule applies
    assert pace.left_s(a, b, late + 2 * catch_up, alone=True) == pytest.approx(-catch_up)
    early = PrefillPace()
    assert early.left_s(a, b, 5.0, alone=True) == pytest.approx(deadline - 5.0)  # on pace: kept


def test_the_pace_deadline_runs_from_the_prompts_arrival_in_real_time():
    pace = PrefillPace()
    s = make()
    a = seq(200, arrival=5.0)
    s.add([a])
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    fresh = TTFT_STRETCH * b.untargeted_s(0, 200)
    assert pace.left_s(a, b, 5.0) == pytest.approx(fresh)  # waiting for the budget counts
    assert pace.left_s(a, b, 5.0 + fresh / 4) == pytest.approx(fresh * 3 / 4)
    step(s, 5.0)
    assert a.status is SeqStatus.RUNNING and 0 < a.num_computed_tokens < 200
    left = pace.left_s(a, b, 5.0)  # running: the deadline is fixed, from its arrival
    assert left == pytest.approx(fresh)
    assert pace.left_s(a, b, 5.0 + left / 2) == pytest.approx(left / 2)
    assert pace.left_s(a, b, 6.0 + left) < 0  # late
    s.preempt(a)  # a recompute is a new turn, from its readmission
    assert pace.left_s(a, b, 50.0) == pytest.approx(fresh)
    a.status, a.timing.prefill_started = SeqStatus.RUNNING, 50.0
    assert pace.left_s(a, b, 50.0) == pytest.approx(fresh)
    with pytest.raises(ValueError, match="stretch"):
        PrefillPace(0.5)


def test_a_prompt_queued_behind_another_gets_the_wait_it_had_without_the_target():
    """B arrives while A runs: B's allowance is the stretch of its time without the target,
    which waits for A's end *without* the target (A's start + its untargeted time), not for
    A's actual, paced, end."""
    pace = PrefillPace()
    s = make()
    a, bq = seq(200, arrival=1.0), seq(160, arrival=1.002)
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    u_a, u_b = b.untargeted_s(0, 200), b.untargeted_s(0, 160)
    assert 1.0 + u_a > 1.002  # A would still run without the target when B arrives
    for q, t in ((a, 1.0), (bq, 1.5)):  # B admitted late: A's paced chunks took the budget
        s.add([q])
        q.status, q.timing.prefill_started = SeqStatus.RUNNING, t
    assert pace.left_s(a, b, 1.5) == pytest.approx(1.0 + TTFT_STRETCH * u_a - 1.5)
    without = 1.0 + u_a + u_b - 1.002  # B's time to first token without the target
    assert pace.left_s(bq, b, 1.5) == pytest.approx(1.002 + TTFT_STRETCH * without - 1.5)


def test_the_floor_keeps_every_queued_prompt_in_time():
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    b.reserve_decodes([40] * 4)
    first = b.pace(0, 200, 0.1)
    both = b.pace_queue(0, [(200, 0.1), (200, 0.12)])  # the second is due soon after
    assert both > first
    assert both == max(first, b.pace(0, 400, 0.12))
    assert b.pace_queue(0, [(200, 0.1), (200, 10.0)]) == first  # not pressed: the first's
    assert b.pace_queue(0, [(100, 0.1), (300, -1.0)]) == 400  # late: all up to its end
    with pytest.raises(ValueError, match="remaining"):
        b.pace_queue(0, [(10, 1.0), (-1, 1.0)])


def periodic_ttfts(target_ms: float | None, period: float, prompts: int = 20) -> list[float]:
    """Four decode streams (replaced when done, so their context stays short) and a 400-token
    prompt every ``period`` s on the virtual clock (each step as long as the cost model
    says): each prompt's arrival to first token."""
    s = make(n_blocks=3000, target_ms=target_ms, max_num_seqs=16)
    streams = [seq(16, max_tokens=48) for _ in range(4)]
    s.add(streams)
    now, arrivals, longs, ttft = 0.0, 0, [], {}
    while len(ttft) < prompts:
        while arrivals < prompts and arrivals * period <= now:
            longs.append(seq(400, max_tokens=2, arrival=arrivals * period))
            s.add([longs[-1]])
            arrivals += 1
        out = step(s, now)
        now += max(COST.step_seconds(out.plan), 1e-4)
        for i, x in enumerate(streams):
            if x.is_finished:
                streams[i] = seq(16, max_tokens=48, arrival=now)
                s.add([streams[i]])
        for q in longs:
            if q.output_token_ids and q.seq_id not in ttft:
                ttft[q.seq_id] = now - q.timing.arrival
    return [ttft[q.seq_id] for q in longs]


def test_prefill_keeps_up_with_prompts_that_arrive_faster_than_their_stretched_time():
    """Prompts arrive every 1.2 × their time without the target, so a prompt paced to the
    stretch (1.5 ×) of its own time, from its admission, falls behind the next arrival and
    the queue grows; paced from its arrival on the untargeted schedule, each keeps within
    the stretch of its time to first token without the target (plus the step it ends in)."""
    alone = periodic_ttfts(None, 10.0, prompts=2)[0]  # a prompt's untargeted time, alone
    period = 1.2 * alone
    off = periodic_ttfts(None, period)
    on = periodic_ttfts(TARGET_MS, period)
    assert TTFT_STRETCH * max(off) < 2 * period  # the old rule would have fallen behind
    for a, b in zip(off, on, strict=True):
        assert b <= TTFT_STRETCH * a + TARGET_MS / 1e3 * 3, (off, on)
    assert max(on[-10:]) <= max(on[:10]) * 1.2  # no growing queue


def test_the_paced_prefill_is_the_oldest_admitted_then_the_next_waiting():
    x, y, w = seq(50), seq(50), seq(50)
    for q, t in ((x, 3.0), (y, 1.0)):
        q.timing.prefill_started = t
    assert paced_prefill([x, y], w) is y
    y.num_computed_tokens = y.num_tokens - 1  # decoding now
    assert paced_prefill([x, y], w) is x
    assert paced_prefill([y], w) is w and paced_prefill([y], None) is None


def test_without_a_target_the_budget_is_the_token_count():
    b = StepBudget(10, BS)
    assert b.grant(3, 7) == 7  # no alignment, no time
    b.take(3, 7)
    assert b.grant(0, 50) == 3 and b.predicted_s() == 0.0
    with pytest.raises(ValueError, match="step-cost model"):
        StepBudget(10, BS, None, 0.05)
    with pytest.raises(ValueError, match="step-cost model"):
        Scheduler(SchedulerConfig(itl_target_ms=50), KVCacheManager(8, BS))
    with pytest.raises(ValueError, match="itl_target_ms"):
        SchedulerConfig(itl_target_ms=0)


def test_a_prefill_chunk_fills_the_step_up_to_the_target_on_a_block_boundary():
    s = make()
    long = seq(200)
    s.add([long])
    out = step(s, now=0.0)
    (chunk,) = out.plan.chunks
    n = len(chunk.token_ids)
    assert n % BS == 0 and 0 < n < 200
    assert COST.step_seconds(out.plan) <= TARGET_MS / 1e3
    # One more block would have broken the target: the chunk is as large as it may be.
    assert COST.predict_step_s(0, n + BS, n + BS) > TARGET_MS / 1e3


def _check_step(out, reserved: set[str], floor: int) -> None:
    """The budget's contract for one scheduled step (``reserved``: the running decode rows)."""
    decode_rows = sum(1 for c in out.plan.chunks if c.seq_id in reserved and len(c.token_ids) == 1)
    counted = sum(len(c.token_ids) for c in out.plan.chunks) - decode_rows
    if COST.step_seconds(out.plan) > TARGET_MS / 1e3 + 1e-12:
        assert counted <= floor, (plan_shape(out.plan), floor)  # past the target only by the floor
    for x, c in zip(out.scheduled, out.plan.chunks, strict=True):
        end = c.num_computed_tokens + len(c.token_ids)
        if not x.sample:  # stops short of the sequence's end: on a block boundary if it can
            assert end % BS == 0 or end // BS * BS <= c.num_computed_tokens, (c.num_computed_tokens, end)


def test_random_mixed_load_never_exceeds_the_target_but_by_the_floor():
    rng = random.Random(11)
    s = make(max_num_seqs=8)
    now, pending = 0.0, [seq(rng.randrange(2, 120), rng.randrange(1, 12)) for _ in range(40)]
    steps = 0
    while pending or s.num_unfinished:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                x = pending.pop()
                x.timing.arrival = now
                s.add([x])
        floor = floor_now(s, now)
        reserved = {x.seq_id for x in s.running if x.num_tokens - x.num_computed_tokens == 1}
        out = step(s, now)
        _check_step(out, reserved, floor)
        now += max(COST.step_seconds(out.plan), 0.001)
        steps += 1
        assert steps < 5000
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def decoding_over_target(max_num_seqs: int, target_ms: float | None = TARGET_MS
                         ) -> tuple[Scheduler, float]:
    """A scheduler whose 12 running sequences all decode (prompts of 300, 400 tokens to go):
    12 rows at ~300 tokens of context predict 1 + 6 + 3.6 ms, over the 5 ms target. Returns
    it and the virtual time after their prefills."""
    s = make(n_blocks=3000, max_num_seqs=max_num_seqs, target_ms=target_ms)
    decoders = [seq(300, max_tokens=400) for _ in range(12)]
    s.add(decoders)
    now = 0.0
    while any(not d.output_token_ids for d in decoders):
        now += COST.step_seconds(step(s, now).plan)
    assert COST.predict_step_s(12, 0, 12 * 301) > TARGET_MS / 1e3
    return s, now


def first_token_s(s: Scheduler, now: float, prompt: int, gaps: list[float] | None = None) -> float:
    """Seconds from a ``prompt``-token arrival at ``now`` to its first token on the virtual
    clock (each step as long as the cost model says); every step must give it tokens.
    ``gaps``: the steps' lengths are appended."""
    late = seq(prompt, max_tokens=2, arrival=now)
    s.add([late])
    start = now
    while not late.output_token_ids:
        out = step(s, now)
        assert any(c.seq_id == late.seq_id for c in out.plan.chunks), "no tokens this step"
        now += COST.step_seconds(out.plan)
        if gaps is not None:
            gaps.append(COST.step_seconds(out.plan))
    return now - start


@pytest.mark.parametrize("prompt", [40, 120, 480])
def test_behind_decodes_over_the_target_a_prompt_keeps_within_the_stretch_of_no_target(prompt):
    """12 decode rows already past the target leave no room: the floor alone carries the
    prompt, in chunks sized from the cost model, and its time to first token stays within
    the stretch of the same prompt's without the target: one step beside the same rows (a
    scheduler run without the target from the start holds its rows at other lengths, so
    its own run of the prompt is compared only loosely)."""
    off, t_off = decoding_over_target(16, target_ms=None)
    on, t_on = decoding_over_target(16)
    whole_step = COST.predict_step_s(len(on.running), prompt, attended(0, prompt) + sum(
        attended(r.num_computed_tokens, 1) for r in on.running))
    gaps: list[float] = []
    with_target = first_token_s(on, t_on, prompt, gaps)
    assert with_target <= TTFT_STRETCH * whole_step + 1e-9
    without = first_token_s(off, t_off, prompt)
    assert abs(whole_step - without) < 0.05 * without  # the same prompt, rows a little apart
    if prompt >= 120:  # (a short prompt may run whole: two steps can miss its deadline)
        assert len(gaps) > 1  # it was paced, not run whole
        assert max(gaps) < without  # and no step as long as the untargeted one


def test_a_queue_waiting_for_seats_does_not_lift_the_floor():
    """Requests that wait for a seat are paced from the last step that refused them one, not
    from their arrival: a prompt admitted after a long wait is chunked over several steps,
    not run whole at once as it would be if that wait counted as lateness (it waited as long
    without the target)."""
    s, now = decoding_over_target(max_num_seqs=13)
    queued = [seq(200, max_tokens=2, arrival=now) for _ in range(6)]
    s.add(queued)
    second, chunks = queued[1], []
    while not second.output_token_ids:
        out = step(s, now)
        chunks.append(sum(len(c.token_ids) for c in out.plan.chunks if c.seq_id == second.seq_id))
        now += COST.step_seconds(out.plan)
    waited = chunks.index(next(c for c in chunks if c))
    assert waited > 1  # it waited for the first's seat
    assert sum(chunks) == 200 and len(chunks) - waited > 1, chunks
    assert all(q.timing.prefill_started is None for q in queued[2:])  # still waiting for a seat


def test_a_preempted_sequence_restarts_its_pace():
    s = make(n_blocks=400)
    a = seq(200, max_tokens=4, arrival=3.0)
    s.add([a])
    step(s, 3.0)
    step(s, 3.01)  # running: its turn's deadline is fixed
    assert 0 < a.num_computed_tokens < 199  # still prefilling
    b = StepBudget(512, BS, COST, TARGET_MS / 1e3)
    late_by = s.pace.left_s(a, b, 1000.0)
    assert late_by < 0
    s.preempt(a)
    assert paced_prefill(s.running, s.waiting[0]) is a
    assert floor_now(s, 1000.0) < 200  # waiting again: a fresh allowance, not all at once
    step(s, 1000.0)
    assert s.pace.left_s(a, b, 1000.0) > 0  # its recompute is a new turn


def test_steps_slower_than_predicted_make_the_prompt_late_and_its_floor_grows():
    """The deadline is in real time: when every step takes 3 × its prediction (time outside
    the forward, a loaded host), the paced prompt falls behind and its floor grows to catch
    up, so it ends in fewer steps than at the predicted pace — prefill keeps up."""

    def chunks_for(slowdown: float) -> list[int]:
        s, now = decoding_over_target(16)
        late = seq(480, max_tokens=2, arrival=now)
        s.add([late])
        sizes = []
        while not late.output_token_ids:
            out = step(s, now)
            sizes += [len(c.token_ids) for c in out.plan.chunks if c.seq_id == late.seq_id]
            now += slowdown * COST.step_seconds(out.plan)
        return sizes

    on_time, slow = chunks_for(1.0), chunks_for(3.0)
    assert sum(on_time) == sum(slow) == 480
    assert len(slow) < len(on_time), (on_time, slow)
    assert max(slow) > max(on_time)
