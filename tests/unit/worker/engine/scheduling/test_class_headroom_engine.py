"""Class headroom through the real engine (tiny Llama): an interactive request runs on top of
a full batch flood (more running rows than ``max_num_seqs``), every logits row within the
exactness tolerance of transformers' on the request's own tokens, and greedy outputs the same
as without the headroom (the seat taken by preemption, before)."""

from __future__ import annotations

import dataclasses

from kvfleet.priority import BATCH, INTERACTIVE
from tests.unit.worker.engine_harness import (
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    seq_tokens,
)


def workload():
    batch = [dataclasses.replace(request(prompt(9, seed=70 + i), max_tokens=8), priority=BATCH)
             for i in range(2)]
    chat = dataclasses.replace(request(prompt(7, seed=79), max_tokens=5), priority=INTERACTIVE)
    return batch, chat


def test_an_interactive_request_on_top_of_the_flood_matches_transformers(tiny_llama_dir) -> None:
    outputs = {}
    for headroom in (1, 0):
        batch, chat = workload()
        engine, rec = make_engine(tiny_llama_dir, max_num_seqs=2, class_headroom=headroom)
        results = run(engine, {0: batch, 2: [chat]})
        rows = max(len(p.chunks) for p in rec.plans)
        assert rows == (3 if headroom else 2), (headroom, rows)  # on top, or in a batch seat
        for r in [*batch, chat]:
            res = results[(r.request_id, 0)]
            assert len(res.token_ids) == r.params.max_tokens
            err = reference_error(tiny_llama_dir, rec, f"{r.request_id}#0", seq_tokens(r, res))
            assert err <= 1, f"{r.request_id}: {err:.2f}x the tolerance (headroom {headroom})"
        outputs[headroom] = [results[(r.request_id, 0)].token_ids for r in [*batch, chat]]
    assert outputs[1] == outputs[0]  # greedy: the same tokens with or without it
