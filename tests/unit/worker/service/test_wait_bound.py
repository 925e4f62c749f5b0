"""The replica's queue bound in seconds: the predicted wait of a newcomer from what the live
requests hold (first come, first served over the seats), refusal past the bound, and the
counts back to zero once the requests leave."""

from __future__ import annotations

import pytest

from kvfleet.errors import ResourceExhausted
from kvfleet.worker.step_cost.queue_delay import QueueState, predict_queue_delay_s
from kvfleet.worker.step_cost.model import CostModel
from kvfleet.worker.service.wait_bound import WaitBound

STEP = CostModel(0.05, 0.0, 0.0, "test: 50 ms per step")  # decode and prefill at one price


def test_a_free_seat_waits_nothing_and_a_queue_waits_its_turns():
    b = WaitBound(10.0, seats=2, batched_tokens=256, step=STEP)
    b.take("a", 0, 20)
    assert b.wait_s() == 0.0  # a seat is free
    b.take("b", 0, 20)
    # Third in line: the first seat frees after ~20 steps / 2 seats of work ahead.
    assert b.wait_s() == pytest.approx(20 / 2 * 0.05)
    for i in range(4):
        b.take(f"w{i}", 0, 20)
    # The engine's own FCFS forecast on the same queue (seats full, four waiting).
    exact = predict_queue_delay_s(QueueState(2, 0, 0, (20, 20), (20,) * 4, 2, 256), STEP)
    assert b.wait_s() == pytest.approx(exact, rel=0.25)


def test_past_the_bound_a_request_is_refused_at_once_naming_it():
    b = WaitBound(3.0, seats=2, batched_tokens=256, step=STEP)
    admitted = 0
    for i in range(20):
        try:
            b.take(f"r{i}", 0, 20)
            admitted += 1
        except ResourceExhausted as exc:
            assert "queue bound of 3 s (max_queue_wait_s)" in str(exc)
    assert admitted == 2 + 6  # two seats, six more start within 3 s (0.5 s of work each)
    assert b.sequences == admitted  # a refusal counts nothing


def test_prompts_queued_and_leaving_requests_are_counted_out():
    prefill = CostModel(0.0, 0.001, 0.0, "test: 1 ms per prompt token")
    b = WaitBound(60.0, seats=4, batched_tokens=100, step=prefill)
    b.take("a", 500, 10, n=2)
    assert b.wait_s() == pytest.approx(500 * 0.001, rel=0.05)  # its prompt goes first
    b.started("a")
    b.started("a")
    assert b.unstarted_prompt == 0 and b.wait_s() == 0.0
    b.take("b", 300, 10)
    b.release("a")
    b.release("b")
    b.release("never-taken")
    assert (b.sequences, b.steps, b.prompt, b.unstarted_prompt) == (0, 0, 0, 0)
    with pytest.raises(ValueError):
        WaitBound(0.0, 4, 100, prefill)
