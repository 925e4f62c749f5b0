"""Cancellation, deadlines and errors through the engine: a request that ends early leaves the
batch at the next step and returns its blocks; a failure stays with its own request; the
survivors' tokens are exactly what they get alone."""

from __future__ import annotations

import time

import pytest

from kvfleet.errors import InvalidArgument, OutOfRange, ResourceExhausted
from kvfleet.worker.engine.request import FinishReason
from tests.unit.worker.engine_harness import collect, make_engine, prompt, request, run, run_alone


def _active_ids(engine) -> set[str]:
    return {s.seq_id for s in engine.scheduler.running}


def test_cancel_running_waiting_and_unforked_samples(tiny_llama_dir) -> None:
    engine, rec = make_engine(tiny_llama_dir, num_blocks=40, max_num_seqs=2)
    keep = request(prompt(9, seed=70), max_tokens=12)
    running = request(prompt(14, seed=71), max_tokens=40)
    waiting = request(prompt(6, seed=72), max_tokens=40, n=2, temperature=1.0)
    results: dict = {}
    for r in (keep, running, waiting):
        engine.add_request(r)
    for _ in range(3):
        collect(results, engine.step())
    assert f"{running.request_id}#0" in _active_ids(engine)
    assert engine.kv.num_free_blocks < engine.kv.num_total_blocks
    collect(results, engine.abort(running.request_id))
    collect(results, engine.abort(waiting.request_id))  # never admitted: leader + unforked sibling
    assert not engine.is_active(running.request_id) and not engine.is_active(waiting.request_id)
    steps_before = len(rec.plans)
    while engine.has_work:
        collect(results, engine.step())
    later = {c.seq_id for p in rec.plans[steps_before:] for c in p.chunks}
    assert later == {f"{keep.request_id}#0"}, "cancelled requests left the batch at once"
    for rid, n in ((running.request_id, 1), (waiting.request_id, 2)):
        for i in range(n):
            assert results[(rid, i)].finish_reason is FinishReason.CANCELLED
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.kv.check_invariants()
    assert run_alone(tiny_llama_dir, keep).token_ids == results[(keep.request_id, 0)].token_ids


def test_deadline_expires_at_the_next_step(tiny_llama_dir) -> None:
    engine, rec = make_engine(tiny_llama_dir)
    late = request(prompt(12, seed=73), max_tokens=50, deadline=time.monotonic() + 3600)
    other = request(prompt(7, seed=74), max_tokens=6)
    results: dict = {}
    engine.add_request(late)
    engine.add_request(other)
    collect(results, engine.step())
    for s in engine._seqs[late.request_id]:  # its deadline passes between two steps
        s.deadline = time.monotonic() - 1
    collect(results, engine.step())
    assert results[(late.request_id, 0)].finish_reason is FinishReason.DEADLINE
    assert all(c.seq_id != f"{late.request_id}#0" for c in rec.plans[-1].chunks)
    while engine.has_work:
        collect(results, engine.step())
    assert results[(other.request_id, 0)].finish_reason is FinishReason.LENGTH
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_a_failing_request_fails_alone(tiny_llama_dir) -> None:
    """Post-processing that raises for one request ends that request with ERROR; the others
    in the same steps finish with their exact tokens."""
    engine, _ = make_engine(tiny_llama_dir)
    bad = request(prompt(8, seed=75), max_tokens=10)
    good = [request(prompt(5 + i, seed=76 + i), max_tokens=8) for i in range(2)]
    for r in (good[0], bad, good[1]):
        engine.add_request(r)
    detok = engine._io[f"{bad.request_id}#0"].detok
    real_push, calls = detok.push, []

    def push(token_ids):
        calls.append(token_ids)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_push(token_ids)

    detok.push = push
    results = run(engine, [])
    failed = results[(bad.request_id, 0)]
    assert failed.finish_reason is FinishReason.ERROR and str(failed.last.error) == "boom"
    assert len(failed.token_ids) == 2
    for g in good:
        res = results[(g.request_id, 0)]
        assert res.finish_reason is FinishReason.LENGTH
        assert run_alone(tiny_llama_dir, g).token_ids == res.token_ids


def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on(tiny_llama_dir) -> None:
    engine, rec = make_engine(tiny_llama_dir)
    real = rec.execute
    state = {"fail": True}

    def execute(plan):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("forward exploded")
        return real(plan)

    rec.execute = execute
    doomed = request(prompt(6, seed=80), max_tokens=5, n=2, temperature=1.0)
    results = run(engine, [doomed])
    assert {results[(doomed.request_id, i)].finish_reason for i in range(2)} == {FinishReason.ERROR}
    after = request(prompt(6, seed=81), max_tokens=5)
    assert run(engine, [after])[(after.request_id, 0)].finish_reason is FinishReason.LENGTH


def test_refusals(tiny_llama_dir) -> None:
    engine, _ = make_engine(tiny_llama_dir, num_blocks=8, max_waiting=0, max_num_seqs=3)
    with pytest.raises(InvalidArgument):
        engine.add_request(request([]))
    with pytest.raises(InvalidArgument):
        engine.add_request(request([engine.vocab_size]))
    with pytest.raises(OutOfRange):
        engine.add_request(request(prompt(250, seed=1), max_tokens=10))  # context is 256
    with pytest.raises(ResourceExhausted, match="8 in total"):  # 8 blocks of 4 = 32 tokens
        engine.add_request(request(prompt(20, seed=1), max_tokens=20))
    with pytest.raises(ResourceExhausted, match="max_num_seqs"):
        engine.add_request(request(prompt(4, seed=1), max_tokens=2, n=5))
    engine.add_request(request(prompt(4, seed=1), max_tokens=2, n=2))
    with pytest.raises(ResourceExhausted, match="queue is full"):
        engine.add_request(request(prompt(4, seed=1), max_tokens=2, n=2))
    assert engine.kv.num_free_blocks == 8 and engine.scheduler.num_unfinished == 2
