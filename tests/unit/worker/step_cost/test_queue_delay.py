"""The queue-delay forecast a replica advertises: a pure function of the scheduler's state and
a step-cost predictor (here a fake with round numbers), plus the snapshot of a real scheduler."""

from __future__ import annotations

import pytest

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.executor.cost_model import MEASURED
from kvfleet.worker.step_cost.model import StepCost
from kvfleet.worker.step_cost.queue_delay import (
    QueueState,
    load_forecast,
    predict_queue_delay_s,
    prefill_token_s,
    throughput_load,
)

BS = 4


class FakeStepCost:
    """1 s per step + 0.01 s per prefill token + 0.1 s per decode row; records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def predict_step_s(self, decode_rows: int, prefill_tokens: int, context_tokens: int,
                       draft_tokens: int = 0) -> float:
        self.calls.append((decode_rows, prefill_tokens, context_tokens))
        return 1.0 + 0.01 * prefill_tokens + 0.1 * decode_rows


def state(decode_rows=0, prefill=0, context=0, running=(), waiting=(), seqs=16, budget=512):
    return QueueState(decode_rows, prefill, context, tuple(running), tuple(waiting), seqs, budget)


def test_an_idle_replica_has_no_queue_delay():
    assert predict_queue_delay_s(state(), FakeStepCost()) == 0.0


def test_prefill_backlog_runs_in_chunks_beside_the_decode_rows():
    fake = FakeStepCost()
    # 1,000 tokens, 2 decode rows: chunks of 510 then 490 tokens, each step with both rows.
    got = predict_queue_delay_s(state(decode_rows=2, prefill=1000, context=300,
                                      running=(5, 5, 9)), fake)
    assert got == pytest.approx((1 + 5.1 + 0.2) + (1 + 4.9 + 0.2))
    assert (2, 510, 300) in fake.calls and (2, 490, 300) in fake.calls


def test_decode_rows_alone_cost_half_the_step_in_flight():
    got = predict_queue_delay_s(state(decode_rows=3, running=(4, 4, 4)), FakeStepCost())
    assert got == pytest.approx(0.5 * 1.3)


def test_a_full_running_set_waits_for_the_first_seat():
    # Two seats, both taken: the one with 3 tokens left frees its seat after 3 decode steps.
    got = predict_queue_delay_s(state(decode_rows=2, running=(5, 3), seqs=2), FakeStepCost())
    assert got == pytest.approx(3 * 1.2 + 0.5 * 1.2)


def test_waiting_sequences_take_the_free_seats_first():
    # Seats free after 3 and 5 steps; the waiting one (8 tokens) takes the first (then runs to
    # step 11), so the newcomer's seat is the one free at step 5.
    got = predict_queue_delay_s(state(decode_rows=2, running=(5, 3), waiting=(8,), seqs=2),
                                FakeStepCost())
    assert got == pytest.approx(5 * 1.2 + 0.5 * 1.2)
    # A free seat left after the waiting one: no seat wait.
    assert predict_queue_delay_s(state(decode_rows=1, running=(9,), waiting=(8,), seqs=3),
                                 FakeStepCost()) == pytest.approx(0.5 * 1.1)


def test_a_seat_wait_past_the_prefill_backlog_adds_decode_steps():
    # 100 tokens to prefill take 1 step; the seat frees after 4: 3 more decode-only steps.
    got = predict_queue_delay_s(state(decode_rows=1, prefill=100, running=(4,), seqs=1),
                                FakeStepCost())
    assert got == pytest.approx((1 + 1.0 + 0.1) + 3 * 1.1)


def test_prefill_token_s_is_the_marginal_cost_of_a_chunk():
    assert prefill_token_s(state(decode_rows=12), FakeStepCost()) == pytest.approx(0.01)
    two_speeds = [prefill_token_s(state(), StepCost(MEASURED.scaled(f))) for f in (1, 2)]
    assert two_speeds[1] == pytest.approx(2 * two_speeds[0])
    assert two_speeds[0] >= MEASURED.prefill_token_s  # plus the KV positions each token attends


_arrival = iter(range(10**6))


def seq(prompt: list[int], max_tokens: int = 8) -> SequenceState:
    a = next(_arrival)
    return SequenceState(seq_id=f"s{a}", request_id=f"s{a}", index=0, prompt_token_ids=prompt,
                         params=SamplingParams(max_tokens=max_tokens), root_hash=b"r" * 16,
                         block_size=BS, arrival_seq=a)


def run_step(s: Scheduler) -> None:
    out = s.schedule()
    s.on_step_done(out)
    for x in out.scheduled:
        if x.sample:
            x.seq.append_token(7)


def test_snapshot_counts_shared_and_cached_prefixes_once():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), KVCacheManager(64, BS))
    shared = list(range(100, 116))  # 4 full blocks
    first = seq(shared + [1, 2, 3])
    s.add([first])
    run_step(s)  # prefilled (19 tokens), now decoding; its 4 shared blocks are cached
    again = seq(shared + [4, 5, 6], max_tokens=5)
    new_a, new_b = seq(list(range(200, 216)) + [9]), seq(list(range(200, 216)) + [8])
    s.add([again, new_a, new_b])
    q = QueueState.of(s)
    assert q.decode_rows == 1 and q.context_tokens == 19
    assert q.running_left == (7,) and q.waiting_steps == (5, 8, 8)
    # again: 3 tokens past the cached prefix; new_a: 17; new_b: its 4 blocks are new_a's.
    assert q.prefill_tokens == 3 + 17 + 1
    assert (q.max_num_seqs, q.max_num_batched_tokens) == (1, 64)


def test_snapshot_without_prefix_caching_counts_every_prompt_token():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(), kv)
    s.add([seq(list(range(100, 117))), seq(list(range(100, 117)))])
    assert QueueState.of(s).prefill_tokens == 34


def test_load_forecast_and_the_predictor_wiring():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100), KVCacheManager(64, BS))
    s.add([seq(list(range(100, 150)))])
    fake = FakeStepCost()
    forecast = load_forecast(s, fake)
    assert forecast == {"queue_delay_s": pytest.approx(1 + 0.5), "prefill_token_s": pytest.approx(0.01),
                        # its 50 prompt tokens are the next step's work; it waits for a seat
                        "throughput_load": pytest.approx(1 - 1.0 / 1.5 + 1 / 16)}


def test_throughput_load_is_the_share_of_full_batch_tokens_per_second():
    # Fake: s(n) = 1 + 0.1 n. 4 of 16 seats: 4/1.4 tokens/s of 16/2.6 at most.
    fake = FakeStepCost()
    assert throughput_load(state(running=(5,) * 4, decode_rows=4), fake) == pytest.approx(
        (4 / 1.4) / (16 / 2.6))
    assert throughput_load(state(), fake) == 0.0
    # Full seats: 1.0; the queue beyond them adds its length in seats.
    full = state(running=(5,) * 16, decode_rows=16, waiting=(8,) * 8)
    assert throughput_load(full, fake) == pytest.approx(1.0 + 8 / 16)
    assert throughput_load(state(waiting=(8,) * 4), fake) == pytest.approx(4 / 16)
    # Prompt tokens in the next step are work too: the unshared fixed cost is a smaller part.
    busy = state(running=(5,) * 4, decode_rows=4, prefill=100)
    assert throughput_load(busy, fake) == pytest.approx(1 - 1.0 * (12 / 16) / 2.4)


def test_throughput_load_is_the_rows_per_second_served_over_the_most_a_replica_serves():
    """In steady state B / s(B) rows/s = arrival rate × output tokens, so the load is linear
    in the arrival rate while the seats in use are not (measured constants)."""
    step, seats = MEASURED, 16
    most = seats / step.predict_step_s(seats, 0, 0)
    for b in range(1, seats + 1):
        load = throughput_load(state(running=(1,) * b, decode_rows=b), step)
        assert load * most == pytest.approx(b / step.predict_step_s(b, 0, 0))
    four = throughput_load(state(running=(1,) * 4, decode_rows=4), step)
    assert four > 2 * 4 / seats  # 4 seats of 16 carry more than half a replica's tokens/s
