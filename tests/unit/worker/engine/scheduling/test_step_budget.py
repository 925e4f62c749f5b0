"""The ITL target's step budget with a fake (fixed, known) cost model and a fake clock: a step
never predicts past the target except by its floor, a waiting prefill always advances, the
floor grows with the oldest wait, and chunks that stop short end on block boundaries."""

from __future__ import annotations

import random

import pytest

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.engine.scheduling.step_budget import (
    FLOOR_CAP,
    FLOOR_GROWTH,
    StepBudget,
    floor_tokens,
    prefill_wait,
)
from kvfleet.worker.step_cost.model import CostModel, plan_shape

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


def oldest_wait(s: Scheduler, now: float, admitted: dict[str, float]) -> float | None:
    """The floor's wait: since the admission (as the test saw it, in ``admitted``) of the
    oldest running sequence still prefilling; 0 if none but one waits."""
    t = [admitted[x.seq_id] for x in s.running if x.num_tokens - x.num_computed_tokens > 1]
    return now - min(t) if t else (0.0 if s.waiting else None)


def note_admissions(out, admitted: dict[str, float], now: float) -> None:
    """Record ``now`` for each sequence that starts a prefill in ``out`` (from 0 tokens or
    its prefix-cache hit: a chunk of a sequence not yet in ``admitted``)."""
    for x in out.scheduled:
        if x.seq.seq_id not in admitted:
            admitted[x.seq.seq_id] = now


def test_floor_grows_by_a_block_per_four_targets_waited():
    assert FLOOR_GROWTH == 4
    assert floor_tokens(16, 0.05, None) == 0
    assert [floor_tokens(16, 0.05, w) for w in (0.0, 0.199, 0.201, 0.51, 2.01)] == [16, 16, 32, 48, 176]


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
    steps, admitted = 0, {}
    while pending or s.num_unfinished:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                x = pending.pop()
                x.timing.arrival = now
                s.add([x])
        floor = floor_tokens(BS, TARGET_MS / 1e3, oldest_wait(s, now, admitted))
        reserved = {x.seq_id for x in s.running if x.num_tokens - x.num_computed_tokens == 1}
        out = step(s, now)
        note_admissions(out, admitted, now)
        _check_step(out, reserved, floor)
        now += max(COST.step_seconds(out.plan), 0.001)
        steps += 1
        assert steps < 5000
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def decoding_over_target(max_num_seqs: int) -> tuple[Scheduler, float]:
    """A scheduler whose 12 running sequences all decode (prompts of 300, 400 tokens to go):
    12 rows at ~300 tokens of context predict 1 + 6 + 3.6 ms, over the 5 ms target. Returns
    it and the virtual time after their prefills."""
    s = make(n_blocks=3000, max_num_seqs=max_num_seqs)
    decoders = [seq(300, max_tokens=400) for _ in range(12)]
    s.add(decoders)
    now = 0.0
    while any(not d.output_token_ids for d in decoders):
        now += COST.step_seconds(step(s, now).plan)
    assert COST.predict_step_s(12, 0, 12 * 301) > TARGET_MS / 1e3
    return s, now


def test_a_waiting_prefill_advances_every_step_even_behind_decodes_over_the_target():
    s, now = decoding_over_target(max_num_seqs=16)
    late = seq(120, max_tokens=2, arrival=now)
    s.add([late])
    chunks = []
    while not late.output_token_ids:
        out = step(s, now)
        mine = [c for c in out.plan.chunks if c.seq_id == late.seq_id]
        assert mine, "the waiting prompt got no tokens this step"
        chunks.append(len(mine[0].token_ids))
        now += COST.step_seconds(out.plan)
    assert sum(chunks) == 120
    assert chunks[0] == BS and chunks[:-1] == sorted(chunks[:-1]) and chunks[-2] > chunks[0], chunks


def test_with_the_target_off_steps_are_the_token_budgets():
    s = make(target_ms=None, max_num_batched_tokens=6)
    a, b = seq(3), seq(10)
    s.add([a, b])
    out = step(s, 0.0)
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [(a.seq_id, 3), (b.seq_id, 3)]


def test_a_queue_waiting_for_seats_does_not_lift_the_floor():
    """Requests that waited long for a seat start at a one-block floor, which then grows with
    the time since their admission: the target keeps acting (it did not when the floor
    counted the wait from arrival: 100 s of queueing lifted it past the token budget)."""
    s, _ = decoding_over_target(max_num_seqs=13)
    queued = [seq(200, max_tokens=2, arrival=0.0) for _ in range(6)]  # waiting since t=0
    s.add(queued)
    now = 100.0
    first = queued[0]
    chunks = []
    while not first.output_token_ids:
        out = step(s, now)
        assert [c.seq_id for c in out.plan.chunks if len(c.token_ids) > 1] == [first.seq_id]
        chunks.append(sum(len(c.token_ids) for c in out.plan.chunks if c.seq_id == first.seq_id))
        assert chunks[-1] == floor_tokens(BS, TARGET_MS / 1e3, now - 100.0) or sum(chunks) == 200
        now += COST.step_seconds(out.plan)
    assert chunks[0] == BS and sum(chunks) == 200 and len(chunks) > 3, chunks
    assert first.timing.prefill_started == 100.0
    assert all(q.timing.prefill_started is None for q in queued[1:])  # still waiting for a seat


def test_a_preempted_sequence_restarts_its_floor():
    s = make(n_blocks=400)
    a = seq(200, max_tokens=4)
    s.add([a])
    step(s, 3.0)
    assert 0 < a.num_computed_tokens < 199  # still prefilling
    assert a.timing.prefill_started == 3.0 and prefill_wait(s.running, bool(s.waiting), 4.0) == 1.0
    s.preempt(a)
    assert a.timing.prefill_started is None and prefill_wait(s.running, bool(s.waiting), 4.0) == 0.0
    s.finish(a)
    assert prefill_wait(s.running, bool(s.waiting), 4.0) is None


def test_a_grown_floor_stops_at_twice_the_target_or_twice_the_decode_rows():
    target = TARGET_MS / 1e3
    alone = StepBudget(512, BS, COST, target, floor=400)
    n = alone.grant(0, 400)
    assert n % BS == 0 and COST.predict_step_s(0, n, n) <= FLOOR_CAP * target
    assert COST.predict_step_s(0, n + BS, n + BS) > FLOOR_CAP * target  # as large as allowed
    # Decode rows predicting past the target themselves: the cap is twice their time.
    behind = StepBudget(512, BS, COST, target, floor=400)
    behind.reserve_decodes([300] * 12)
    assert behind.decodes_s > target
    m = behind.grant(0, 400)
    assert COST.predict_step_s(12, m, 12 * 301 + m) <= FLOOR_CAP * behind.decodes_s
    assert m > n // 2 and m > BS
    # A floor of one block is never capped.
    assert StepBudget(512, BS, COST, 0.0001, floor=BS).grant(0, 400) == BS
