"""Speculative decoding never changes an answer: the engine with drafts against the same
engine without, on the exactness scenarios (chunked prefill, preemption, n > 1, penalties,
logprobs, stop strings, ``max_tokens``), and every logits row it kept against transformers.

Drafts come from an oracle (:func:`spec_harness.oracle`: the plain continuation with planted
mistakes), so every verification path runs: whole drafts accepted, cut short at each
position, rejected at once. Greedy tokens must be identical (no near-ties occur on these
seeded models: a divergence fails the test); logprobs equal within fp32 noise.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.unit.worker.engine.speculative.spec_harness import drafted_chunks, use_oracle
from tests.unit.worker.engine_harness import (
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    run_preempting,
    seq_tokens,
)

LENGTHS = [(5, 9), (23, 4), (14, 12), (3, 7), (31, 5), (9, 10), (18, 3), (11, 8)]


def _plain_and_spec(model_dir, reqs, arrivals=None, preempting: bool = False, k: int = 4,
                    **scheduler):
    """Both runs of ``reqs``: ``(plain results, spec results, spec engine, spec recorder)``."""
    arrivals = arrivals or {0: reqs}
    engine, _ = make_engine(model_dir, **scheduler)
    plain = run_preempting(engine, reqs)[0] if preempting else run(engine, arrivals)
    by_id = {r.request_id: r for r in reqs}
    refs = {f"{rid}#{i}": list(by_id[rid].prompt_token_ids) + res.token_ids
            for (rid, i), res in plain.items()}
    engine, rec = make_engine(model_dir, speculative="ngram", speculative_tokens=k, **scheduler)
    use_oracle(engine, refs, k)
    spec = run_preempting(engine, reqs)[0] if preempting else run(engine, arrivals)
    return plain, spec, engine, rec


def _same_answers(model_dir, reqs, plain, spec, rec) -> None:
    for req in reqs:
        for i in range(req.params.n):
            key = (req.request_id, i)
            a, b = plain[key], spec[key]
            assert b.token_ids == a.token_ids, f"{key}: speculative tokens differ"
            assert b.text == a.text and b.finish_reason == a.finish_reason
            assert len(b.logprobs) == len(a.logprobs)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
            err = reference_error(model_dir, rec, f"{req.request_id}#{i}", seq_tokens(req, b))
            assert err <= 1, f"{key}: {err:.2f}x the tolerance"


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen3_dir"], indirect=True)
def test_mixed_batch_with_chunked_prefill(model_dir) -> None:
    """Eight requests joining and leaving, prefill chunks beside verify rows in one step."""
    reqs = [request(prompt(p, seed=10 + i), max_tokens=m) for i, (p, m) in enumerate(LENGTHS)]
    arrivals = {0: reqs[:2], 1: [reqs[2]], 3: reqs[3:5], 6: [reqs[5]], 9: reqs[6:]}
    plain, spec, engine, rec = _plain_and_spec(model_dir, reqs, arrivals,
                                               max_num_batched_tokens=24)
    _same_answers(model_dir, reqs, plain, spec, rec)
    counts = engine.scheduler.spec.counts
    assert counts.accepted > 0 and counts.accepted < counts.drafted  # accepted and rejected
    assert counts.accepted_hist[0] > 0 and sum(counts.accepted_hist[2:]) > 0
    assert any(len({c.num_draft_tokens > 0 for c in p.chunks} | {len(c.token_ids) > 1
               and not c.num_draft_tokens for c in p.chunks}) == 2 for p in rec.plans), \
        "some step must hold a verify row beside a prefill chunk"
    steps_plain = sum(r.params.max_tokens for r in reqs)
    assert sum(len(r.token_ids) for r in spec.values()) == steps_plain


def test_preemption_with_drafts_in_flight(tiny_llama_dir) -> None:
    """Ten blocks for three growing requests: preemption by recompute while rows carry
    drafts; rejected drafts' blocks go back (``run`` checks no block leaks)."""
    reqs = [request(prompt(6, seed=20 + i), max_tokens=12) for i in range(3)]
    plain, spec, engine, rec = _plain_and_spec(tiny_llama_dir, reqs, preempting=True,
                                               num_blocks=10, watermark=0.0)
    _same_answers(tiny_llama_dir, reqs, plain, spec, rec)
    assert engine.scheduler.spec.counts.drafted > 0


def test_n2_penalties_logprobs_and_stop_string(tiny_llama_dir) -> None:
    """n = 2 siblings (forked after the prompt), repetition / frequency / presence penalties
    (each draft position sees the tokens verified before it), top-5 logprobs, and a stop
    string that ends a sample inside an accepted draft."""
    base = request(prompt(9, seed=31), max_tokens=12, n=2, logprobs=5,
                   repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    engine, _ = make_engine(tiny_llama_dir)
    # A stop string: the text of a token in the middle of sample 0's plain answer.
    tokens = run(engine, [base])[(base.request_id, 0)].token_ids
    stop = engine.tokenizer.decode(tokens[7:8])
    stopped = dataclasses.replace(base, request_id="stopped", params=dataclasses.replace(
        base.params, stop=(stop,)) if stop.strip() else base.params)
    reqs = [base, stopped]
    plain, spec, engine, rec = _plain_and_spec(tiny_llama_dir, reqs)
    _same_answers(tiny_llama_dir, reqs, plain, spec, rec)
    assert all(drafted_chunks(rec.plans, f"{base.request_id}#{i}") for i in range(2))


def test_max_tokens_bounds_the_drafts(tiny_llama_dir) -> None:
    """A row never drafts past ``max_tokens``: no chunk's last position reaches
    ``prompt + max_tokens - 1`` and each answer has exactly ``max_tokens`` tokens."""
    reqs = [request(prompt(7, seed=40 + i), max_tokens=m) for i, m in enumerate((2, 5, 11))]
    plain, spec, _, rec = _plain_and_spec(tiny_llama_dir, reqs, k=8)
    _same_answers(tiny_llama_dir, reqs, plain, spec, rec)
    for req in reqs:
        limit = len(req.prompt_token_ids) + req.params.max_tokens - 1
        last = [c.num_computed_tokens + len(c.token_ids) for p in rec.plans for c in p.chunks
                if c.seq_id == f"{req.request_id}#0"]
        assert max(last) <= limit
        assert len(spec[(req.request_id, 0)].token_ids) == req.params.max_tokens
    assert drafted_chunks(rec.plans, f"{reqs[2].request_id}#0")


def test_seeded_sampling_is_the_plain_sampling(tiny_llama_dir) -> None:
    """Random rows: the token at each position is drawn as without drafts and a draft is
    accepted iff it equals that draw, so a seeded request gives the same answer with
    speculation on (n = 1 and n = 2), and again on a second speculative run."""
    reqs = [request(prompt(8, seed=50 + i), max_tokens=10, temperature=0.9, top_p=0.95,
                    top_k=50, seed=1234 + i, n=1 + i, logprobs=2) for i in range(2)]
    plain, spec, _, rec = _plain_and_spec(tiny_llama_dir, reqs)
    _same_answers(tiny_llama_dir, reqs, plain, spec, rec)
    assert drafted_chunks(rec.plans, f"{reqs[0].request_id}#0")
    engine, _ = make_engine(tiny_llama_dir, speculative="ngram")
    use_oracle(engine, {f"{rid}#{i}": list(reqs[0 if rid == reqs[0].request_id else 1]
                                            .prompt_token_ids) + r.token_ids
                        for (rid, i), r in plain.items()})
    again = run(engine, reqs)
    assert {k: r.token_ids for k, r in again.items()} == {k: r.token_ids for k, r in spec.items()}


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("drafts", [1, 3, 4, 6])
def test_verify_rows_are_the_plain_decodes_bit_for_bit(tiny_llama_dir, drafts, quant) -> None:
    """On the CPU kernels (fp32 activations) a verify chunk's logits rows are exactly those of
    the same tokens decoded one step at a time: its projections run each row as a one-row
    product would, its attention each row as the decode at that position (up to the few-row
    kernel's row limit, beside another decode row as in a batch). With int8 weights the
    verify-only step runs the one-call decode layer, whose rows are decodes too."""
    import torch

    from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
    from kvfleet.worker.runner.model_runner import ModelRunner
    from kvfleet.worker.runner.quant.config import FLOAT_WEIGHTS, QuantConfig

    runner = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=4,
                         quantization=QuantConfig(quant) if quant else FLOAT_WEIGHTS)
    head = prompt(13, seed=7)
    tokens = prompt(drafts + 1, seed=8)
    tables = {"plain": tuple(range(0, 8)), "spec": tuple(range(8, 16)), "other": tuple(range(16, 24))}
    for name, table in tables.items():
        runner.execute(StepPlan((SeqChunk(name, tuple(head), 0, table),)))
    other = SeqChunk("other", (5,), len(head), tables["other"])
    plain = [runner.execute(StepPlan((SeqChunk("plain", (t,), len(head) + j, tables["plain"]),)))[0]
             for j, t in enumerate(tokens)]
    spec = runner.execute(StepPlan((other, SeqChunk("spec", tuple(tokens), len(head), tables["spec"],
                                                    num_draft_tokens=drafts))))
    assert spec.shape[0] == 2 + drafts
    for j in range(drafts + 1):
        assert torch.equal(spec[1 + j], plain[j]), j
