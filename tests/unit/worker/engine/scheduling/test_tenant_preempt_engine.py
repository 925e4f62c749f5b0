"""A seat for the tenant behind through the real engine (tiny Llama): the more-served tenant's
newest sequence is preempted for the other's prompt, recomputed later, and every logits row of
every request (the recompute's too) matches transformers' full-prefix forward; the preempted
request's tokens are those it gets alone."""

from __future__ import annotations

import dataclasses

from kvfleet.worker.engine.engine import Engine, EngineRequest
from tests.unit.worker.engine_harness import (
    make_engine,
    prompt,
    reference_error,
    request,
    run_alone,
    seq_tokens,
)
from tests.unit.worker.engine_harness import run as run_all


def tenant(req: EngineRequest, name: str) -> EngineRequest:
    return dataclasses.replace(req, tenant=name)


def test_the_preempted_sequence_recomputes_exactly(tiny_llama_dir) -> None:
    # 4 seats (2 a tenant's share), one step's credit of 32 tokens: A's 30-token prompts put
    # A far ahead of B's 5-token ones; B's third prompt then finds every seat held
    a_reqs = [tenant(request(prompt(30, seed=70 + i), max_tokens=10), "A") for i in range(3)]
    b_reqs = [tenant(request(prompt(5, seed=80 + i), max_tokens=10), "B") for i in range(3)]
    arrivals = {0: [*a_reqs, *b_reqs[:2]], 4: [b_reqs[2]]}
    engine, rec = make_engine(tiny_llama_dir, max_num_seqs=4, max_num_batched_tokens=32,
                              tenant_share=0.5)
    preempted: set[str] = set()

    def watch(k: int, eng: Engine) -> None:
        preempted.update(s.seq_id for s in eng.scheduler.waiting if s.num_preemptions)

    results = run_all(engine, arrivals, on_step=watch)
    assert preempted and all(p.startswith(tuple(r.request_id for r in a_reqs)) for p in preempted)
    counted = engine.stats()["preemptions"]  # what the worker's metrics export
    assert counted["tenant_seat"] >= len(preempted) and counted["class"] == 0
    errors = {r.request_id: reference_error(tiny_llama_dir, rec, f"{r.request_id}#0",
                                            seq_tokens(r, results[(r.request_id, 0)]))
              for r in a_reqs + b_reqs}
    assert max(errors.values()) <= 1, errors
    for r in a_reqs:
        if f"{r.request_id}#0" in preempted:
            assert results[(r.request_id, 0)].token_ids == run_alone(tiny_llama_dir, r).token_ids
