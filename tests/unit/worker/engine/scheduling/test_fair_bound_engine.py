"""The over-served tenant's bounded prefill through the real engine (tiny Llama, a fixed
step-cost model): its prompt is cut into shorter chunks beside the less-served tenant's rows,
and every logits row still matches transformers' full-prefix forward."""

from __future__ import annotations

import dataclasses
import itertools

from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.step_cost.model import CostModel, StepCost
from tests.unit.worker.engine_harness import make_engine, prompt, reference_error, request, seq_tokens
from tests.unit.worker.engine_harness import run as run_all

# 10 ms a step, 4 ms a decode row, 1 ms a prefill token: over-served prefill beside n decode
# rows gets 0.5 × (10 + 4n) ms, a few tokens, far below the token budget.
COST = CostModel(step_base_s=0.010, prefill_token_s=0.001, decode_token_s=0.004)


def tenant(req: EngineRequest, name: str) -> EngineRequest:
    return dataclasses.replace(req, tenant=name)


def long_prompt_chunks(model_dir, bounded: bool):
    """Tenant A served first, then B's two prompts and A's 30-token one: the engine, its
    recorder, the results, the requests and the chunks A's long prompt's prefill ran in."""
    a_first = tenant(request(prompt(24, seed=90), max_tokens=6), "A")
    b_rows = [tenant(request(prompt(5, seed=91), max_tokens=8), "B"),
              tenant(request(prompt(6, seed=92), max_tokens=8), "B")]
    a_long = tenant(request(prompt(30, seed=93), max_tokens=3), "A")
    arrivals = {0: [a_first], 1: [*b_rows, a_long]}
    engine, rec = make_engine(model_dir, max_num_batched_tokens=32, tenant_share=0.5,
                              step_cost=StepCost(COST, alpha=0.0))
    if not bounded:
        engine.scheduler.fair_slack = None
    results = run_all(engine, arrivals)
    long_id = f"{a_long.request_id}#0"
    sizes = [len(c.token_ids) for p in rec.plans for c in p.chunks if c.seq_id == long_id]
    prefill = list(itertools.takewhile(lambda k: sum(sizes[:k]) < 30, range(1, len(sizes))))
    return engine, rec, results, [a_first, *b_rows, a_long], sizes[:len(prefill) + 1]


def test_the_bounded_flood_prompt_is_chunked_and_matches_transformers(tiny_llama_dir) -> None:
    engine, rec, results, reqs, chunk_sizes = long_prompt_chunks(tiny_llama_dir, bounded=True)
    # bounded beside B's decode rows: more chunks than the token budget alone would cut
    assert sum(chunk_sizes) == 30 and len(chunk_sizes) > 2 and max(chunk_sizes) < 32 - 3
    *_, unbounded = long_prompt_chunks(tiny_llama_dir, bounded=False)  # control
    assert len(unbounded) < len(chunk_sizes) and max(unbounded) > max(chunk_sizes)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks, "blocks leaked"
    errors = {r.request_id: reference_error(tiny_llama_dir, rec, f"{r.request_id}#0",
                                            seq_tokens(r, results[(r.request_id, 0)]))
              for r in reqs}
    assert max(errors.values()) <= 1, errors
