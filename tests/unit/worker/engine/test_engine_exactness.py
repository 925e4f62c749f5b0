"""The real Scheduler + Engine + ModelRunner against transformers' full-prefix forward.

fp32; every logits row the engine computed (captured by ``RecordingExecutor``) within
1e-4 x max(1, max|ref|) of transformers on the sequence's own tokens (``scaled_error <= 1``).
Block size 4, so chunk widths and prefix lengths below are deliberately not multiples of it.
Every scenario runs twice: with the token budget alone, and with an ITL target whose (fixed,
fake) cost model allows 6 tokens a step, which moves the chunk boundaries (``budget``).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.priority import BATCH, INTERACTIVE
from tests.unit.worker.engine_harness import (
    BLOCK_SIZE,
    ITL_TARGET,
    ITL_TARGET_GEMM,
    by_position,
    make_engine,
    positions,
    prompt,
    reference_error,
    request,
    run,
    run_alone,
    run_preempting,
    seq_tokens,
)
from tests.unit.worker.paged_driver import scaled_error


@pytest.fixture(params=["tokens", "itl-target", "itl-target-gemm"])
def budget(request) -> dict:
    """``make_engine`` arguments of the step budget under test."""
    return {"itl-target": ITL_TARGET, "itl-target-gemm": ITL_TARGET_GEMM}.get(request.param, {})


# The scheduler's chunking (one token a step, uneven widths) and its joins and leaves, under
# both budgets: no family changes them, and every family's forward over the same chunk widths
# (token by token, uneven chunks, mixed batches against each alone) is test_parity_tiny's.
LLAMA = pytest.mark.parametrize("model_dir", ["tiny_llama_dir"], indirect=True)
# The cache-path scenarios (prefix hits, preemption + recompute, copy-on-write) for Llama under
# both budgets, and for each family whose decoder differs under the token budget (the budget
# moves chunk boundaries, which no family changes).
CACHE_PATHS = pytest.mark.parametrize("model_dir, budget", [
    ("tiny_llama_dir", "tokens"), ("tiny_llama_dir", "itl-target"),
    *((f, "tokens") for f in ("tiny_llama3_dir", "tiny_qwen3_dir", "tiny_gemma3_dir",
                              "tiny_phi3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir",
                              "tiny_gpt_oss_dir"))], indirect=True)


def _check(model_dir, rec, req, res, index: int = 0) -> None:
    err = reference_error(model_dir, rec, f"{req.request_id}#{index}", seq_tokens(req, res))
    assert err <= 1, f"{req.request_id}#{index}: {err:.2f}x the tolerance"


@LLAMA
def test_token_by_token(model_dir, budget) -> None:
    """A budget of one token per step: the prompt is fed one token at a time, then decodes."""
    engine, rec = make_engine(model_dir, max_num_batched_tokens=1, **budget)
    req = request(prompt(13, seed=1), max_tokens=8)
    res = run(engine, [req])[(req.request_id, 0)]
    assert len(res.token_ids) == 8
    assert positions(rec, f"{req.request_id}#0") == list(range(13 + 7))
    _check(model_dir, rec, req, res)


@LLAMA
def test_uneven_chunks(model_dir, budget) -> None:
    widths = [5, 11, 3, 7, 2, 6]  # 34 prompt tokens, none a multiple of the block size of 4
    engine, rec = make_engine(model_dir, **budget)
    req = request(prompt(34, seed=2), max_tokens=6)
    res = run(engine, [req], budgets=lambda k: widths[k] if k < len(widths) else 64)[(req.request_id, 0)]
    chunks = [len(p.chunks[0].token_ids) for p in rec.plans]
    if budget:  # at most 6 tokens a step, cut back to block boundaries where they can be
        starts = [p.chunks[0].num_computed_tokens for p in rec.plans]
        prefill = [(c, n, w) for c, n, w in zip(starts, chunks, widths + [64] * 99, strict=False)
                   if c < 34]
        assert sum(n for _, n, _ in prefill) == 34 and chunks[len(prefill):] == [1] * 5
        assert chunks[:len(widths)] != widths
        for c, n, w in prefill[:-1]:
            assert n <= min(w, 6) and ((c + n) % BLOCK_SIZE == 0 or (c + n) // BLOCK_SIZE * BLOCK_SIZE <= c)
    else:
        assert chunks[:6] == widths and chunks[6:] == [1] * 5
    _check(model_dir, rec, req, res)


@CACHE_PATHS
def test_prefix_hits_full_and_mid_block(model_dir, budget) -> None:
    """A second request reuses the cached full blocks of the first; a third whose shared prefix
    ends mid-block reuses only the full blocks before it and computes the rest."""
    engine, rec = make_engine(model_dir, **budget)
    base = prompt(22, seed=3)
    first = request(base, max_tokens=4)
    same_16 = request(base[:16] + prompt(9, seed=4), max_tokens=5)    # 4 full blocks shared
    same_18 = request(base[:18] + prompt(7, seed=5), max_tokens=5)    # shared prefix ends mid-block
    whole = request(base, max_tokens=3)                               # the whole prompt again
    results = run(engine, {0: [first], 8: [same_16], 16: [same_18], 24: [whole]})
    cached = {r.request_id: results[(r.request_id, 0)].last.usage.cached_prompt_tokens
              for r in (first, same_16, same_18, whole)}
    # 22 tokens: at most (22 - 1) // 4 = 5 blocks reusable, the last prompt token is recomputed.
    assert cached == {first.request_id: 0, same_16.request_id: 16, same_18.request_id: 16,
                      whole.request_id: 20}
    for r in (same_16, same_18, whole):
        first_chunk = next(c for p in rec.plans for c in p.chunks if c.seq_id == f"{r.request_id}#0")
        assert first_chunk.num_computed_tokens == cached[r.request_id]
        _check(model_dir, rec, r, results[(r.request_id, 0)])


@LLAMA
def test_mixed_batch_of_eight_joining_and_leaving_equals_each_alone(model_dir, budget) -> None:
    """Eight requests of different lengths arrive at different steps and finish at different
    steps; prefill chunks share steps with decodes. Each request's logits equal those it gets
    alone (batch invariance) and transformers'."""
    lengths = [(5, 9), (23, 4), (14, 12), (3, 7), (31, 5), (9, 10), (18, 3), (11, 8)]
    reqs = [request(prompt(p, seed=10 + i), max_tokens=m) for i, (p, m) in enumerate(lengths)]
    arrivals = {0: reqs[:2], 1: [reqs[2]], 3: reqs[3:5], 6: [reqs[5]], 9: reqs[6:]}
    engine, rec = make_engine(model_dir, max_num_batched_tokens=24, **budget)
    results = run(engine, arrivals)
    # Under the target the paced floor finishes prompts in fewer, larger chunks: 4 at once.
    assert max(len(p.chunks) for p in rec.plans) >= (4 if budget else 5)
    assert any(len({len(c.token_ids) > 1 for c in p.chunks}) == 2 for p in rec.plans), \
        "some step must mix prefill chunks and decodes"
    for req in reqs:
        res = results[(req.request_id, 0)]
        assert len(res.token_ids) == req.params.max_tokens
        _check(model_dir, rec, req, res)
        alone_engine, alone_rec = make_engine(model_dir)
        alone = run(alone_engine, [req])[(req.request_id, 0)]
        assert alone.token_ids == res.token_ids
        seq_id = f"{req.request_id}#0"
        ours, solo = by_position(rec, seq_id), by_position(alone_rec, seq_id)
        common = {p: ours[p] for p in solo.keys() & ours.keys()}
        assert len(common) >= req.params.max_tokens
        assert scaled_error(common, solo) <= 1, req.request_id


@CACHE_PATHS
def test_preempted_then_resumed(model_dir, budget) -> None:
    """Eight blocks of four tokens for three growing requests: the newest is preempted by
    recompute, resumes later, and ends with exactly the tokens and logits it gets alone."""
    reqs = [request(prompt(6, seed=20 + i), max_tokens=12) for i in range(3)]
    engine, rec = make_engine(model_dir, num_blocks=10, watermark=0.0, **budget)
    results, preempted = run_preempting(engine, reqs)
    for req in reqs:
        res = results[(req.request_id, 0)]
        _check(model_dir, rec, req, res)
        assert run_alone(model_dir, req).token_ids == res.token_ids
    widths = [len(c.token_ids) for p in rec.plans for c in p.chunks if c.seq_id == preempted[0]]
    assert max(widths[widths.index(1):]) > 1, "the preempted sequence recomputed after decoding"


def test_rows_sitting_out_for_a_higher_class_or_less_served_tenant(tiny_llama_dir) -> None:
    """With the ITL target, batch rows sit out steps while interactive prompts (and a newly
    arrived tenant's) prefill (``class_step``): every logits row still matches transformers'
    on the request's own tokens."""
    def req(n: int, seed: int, **fields):
        return dataclasses.replace(request(prompt(n, seed=seed), max_tokens=6), **fields)
    batch = [req(9, 50 + i, priority=BATCH, tenant="b") for i in range(3)]
    chat = [req(13, 60, priority=INTERACTIVE, tenant="c"), req(7, 61, priority=INTERACTIVE)]
    other = req(11, 62, priority=BATCH, tenant="late")
    engine, rec = make_engine(tiny_llama_dir, **ITL_TARGET)
    sat_out: list[int] = []
    results = run(engine, {0: batch, 4: chat[:1], 6: [chat[1], other]},
                  on_step=lambda k, e: sat_out.append(len(e.scheduler.skipped)))
    assert max(sat_out) >= 2, "some step left rows out"
    for r in [*batch, *chat, other]:
        _check(tiny_llama_dir, rec, r, results[(r.request_id, 0)])


@CACHE_PATHS
def test_n2_siblings_after_copy_on_write(model_dir, budget) -> None:
    """n=2 sampled siblings fork one prompt (10 tokens: 2 full blocks + a half-full one): the
    prompt is computed once, the shared partial block is copied before a sibling writes into
    it, and each sibling's logits equal transformers' on its own tokens."""
    engine, rec = make_engine(model_dir, **budget)
    req = request(prompt(10, seed=30), max_tokens=9, n=2, temperature=1.0, seed=7)
    results = run(engine, [req])
    a, b = results[(req.request_id, 0)], results[(req.request_id, 1)]
    assert a.token_ids != b.token_ids, "seeded siblings must diverge"
    prompt_chunks = [c for p in rec.plans for c in p.chunks if c.num_computed_tokens < 10]
    assert {c.seq_id for c in prompt_chunks} == {f"{req.request_id}#0"}, "prompt computed once"
    assert sum(len(c.token_ids) for c in prompt_chunks) == 10
    assert len(prompt_chunks) == (2 if budget else 1)  # 6 tokens a step under the target: 4 + 6
    copies = [cp for p in rec.plans for cp in p.block_copies]
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == prompt_chunks[-1].block_table[10 // BLOCK_SIZE] and dst != src
    for index, res in enumerate((a, b)):
        _check(model_dir, rec, req, res, index)
        assert b.last.usage.prompt_tokens == 10


def test_sliding_window_beyond_the_window(tiny_mistral_dir) -> None:
    engine, rec = make_engine(tiny_mistral_dir)
    assert rec.config.sliding_window == 8
    req = request(prompt(27, seed=40), max_tokens=12)
    widths = [5, 11, 3, 8]
    res = run(engine, [req], budgets=lambda k: widths[k] if k < len(widths) else 64)[(req.request_id, 0)]
    _check(tiny_mistral_dir, rec, req, res)
