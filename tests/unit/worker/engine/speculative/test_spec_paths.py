"""Speculative decoding along the engine's other paths: tensor parallelism (drafts in the
step plan rank 0 runs), LoRA rows, structured-output rows (never speculate), the per-request
opt-out, the suffix index across requests of one scope (and not across scopes), the n-gram
drafter on its own, and the sampled distribution on a tiny-vocabulary model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfleet.constraint import Constraint
from kvfleet.worker.step_cost.model import ZERO, StepCost
from tests.fixtures.models import write_tiny_model
from tests.unit.worker import engine_harness
from tests.unit.worker.engine.speculative.spec_harness import drafted_chunks, use_oracle
from tests.unit.worker.engine.speculative.test_spec_exactness import (
    LENGTHS,
    _plain_and_spec,
    _same_answers,
)
from tests.unit.worker.engine_harness import make_engine, prompt, request, run
from tests.unit.worker.executor.tp.thread_executor import thread_executor
from tests.unit.worker.lora_harness import lora_error, make_lora_engine, preload, with_adapter
from tests.unit.worker.paged_driver import reference_logits


def test_tp2_drafts_travel_in_the_step_plan(tiny_llama_dir, monkeypatch) -> None:
    """tp = 2 thread ranks: rank 1 computes the drafts' K/V as plain tokens of the chunk;
    answers and kept logits equal the plain tp = 2 run's and transformers'."""
    with thread_executor(tiny_llama_dir, 2) as ex:
        monkeypatch.setattr(engine_harness, "runner_for", lambda model_dir, block_size=4: ex)
        reqs = [request(prompt(p, seed=10 + i), max_tokens=m)
                for i, (p, m) in enumerate(LENGTHS[:4])]
        plain, spec, engine, rec = _plain_and_spec(tiny_llama_dir, reqs, max_num_batched_tokens=24)
        _same_answers(tiny_llama_dir, reqs, plain, spec, rec)
        assert engine.scheduler.spec.counts.accepted > 0


def test_lora_rows_verify_under_their_adapter(tiny_llama_dir, tiny_adapters) -> None:
    """Rows of two adapters and the base model carry drafts in one batch: every kept logits
    row matches peft's for its adapter, and the answers equal the plain run's."""
    names = ["qv", "all", ""]
    reqs = [with_adapter(request(prompt(7 + 3 * i, seed=80 + i), max_tokens=9), names[i])
            for i in range(3)]
    answers = {}
    for mode in ("off", "ngram"):
        engine, rec, residency = make_lora_engine(
            tiny_llama_dir, {n: tiny_adapters[n] for n in names if n}, speculative=mode)
        preload(residency, [n for n in names if n])
        if mode == "ngram":
            use_oracle(engine, {f"{r.request_id}#0": list(r.prompt_token_ids) + answers[r.request_id]
                                for r in reqs})
        results = run(engine, [dataclasses.replace(r) for r in reqs])
        for r in reqs:
            res = results[(r.request_id, 0)]
            if mode == "off":
                answers[r.request_id] = res.token_ids
            else:
                assert res.token_ids == answers[r.request_id]
                adapter = tiny_adapters[r.adapter] if r.adapter else None
                assert lora_error(tiny_llama_dir, adapter, rec, r, res) <= 1
        if mode == "ngram":
            assert len({c.adapter_slot for p in rec.plans for c in p.chunks
                        if c.num_draft_tokens}) >= 2, "rows of several adapters verify drafts"
            assert engine.scheduler.spec.counts.accepted > 0


def test_structured_output_and_opted_out_rows_never_carry_drafts(tiny_llama_dir) -> None:
    """A constrained row is not speculated (its grammar would have to mask each draft
    position); a request with ``speculative=False`` opts out; a free row beside them does."""
    free = request(prompt(6, seed=90), max_tokens=10)
    digits = dataclasses.replace(request(prompt(6, seed=91), max_tokens=10),
                                 constraint=Constraint("regex", "[0-9]{10}", "regex"))
    opted = request(prompt(6, seed=92), max_tokens=10, speculative=False)
    engine, rec = make_engine(tiny_llama_dir, speculative="ngram")
    engine.scheduler.spec.propose = lambda seq: (7, 7, 7)  # type: ignore[method-assign]
    results = run(engine, [free, digits, opted])
    assert drafted_chunks(rec.plans, f"{free.request_id}#0")
    assert not drafted_chunks(rec.plans, f"{digits.request_id}#0")
    assert not drafted_chunks(rec.plans, f"{opted.request_id}#0")
    assert results[(digits.request_id, 0)].text.isdigit()


def test_suffix_index_drafts_within_a_scope_only(tiny_llama_dir) -> None:
    """``suffix``: a request repeating an earlier one of its scope drafts that one's answer
    from its first decode on (every draft accepted); the same request under another cache
    salt finds nothing there (it drafts only from its own tokens, later)."""
    first = request(prompt(9, seed=95), max_tokens=16)
    engine, rec = make_engine(tiny_llama_dir, speculative="suffix")
    answer = run(engine, [first])[(first.request_id, 0)].token_ids
    again = dataclasses.replace(first, request_id="again")
    salted = dataclasses.replace(first, request_id="salted", cache_salt="other tenant")
    results = run(engine, [again, salted])
    assert results[("again", 0)].token_ids == answer == results[("salted", 0)].token_ids
    m = results[("again", 0)].last.milestones
    assert m.spec_drafted > 0 and m.spec_accepted == m.spec_drafted
    first_decode = len(first.prompt_token_ids) - 1  # its prompt blocks are cached: 1 token
    (drafts,) = [c.num_draft_tokens for p in rec.plans for c in p.chunks
                 if c.seq_id == "again#0" and c.num_computed_tokens == first_decode]
    assert drafts > 0
    assert all(c.num_draft_tokens == 0 for p in rec.plans for c in p.chunks
               if c.seq_id == "salted#0" and c.num_computed_tokens <= first_decode + 1)
    engine.scheduler.spec.suffix.check_invariants()


def test_ngram_drafter_from_the_sequence_itself(tiny_llama_dir) -> None:
    """The n-gram drafter alone (no oracle) on an answer that repeats itself: it drafts
    from the sequence's own tokens and the answer equals the plain one."""
    reqs = [request(prompt(9, seed=95), max_tokens=40)]
    engine, _ = make_engine(tiny_llama_dir)
    plain = run(engine, reqs)
    engine, rec = make_engine(tiny_llama_dir, speculative="ngram")
    spec = run(engine, reqs)
    assert {k: r.token_ids for k, r in spec.items()} == {k: r.token_ids for k, r in plain.items()}
    assert engine.scheduler.spec.counts.drafted > 0


@pytest.fixture(scope="module")
def vocab8_dir(tmp_path_factory, smollm2_dir):
    return write_tiny_model(tmp_path_factory.mktemp("vocab8"), "llama", smollm2_dir, seed=7,
                            vocab_size=8, initializer_range=0.5)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_distribution_is_the_models(vocab8_dir) -> None:
    """Vocabulary of 8, temperature 1, 600 seeds, a fixed two-token draft on every decode
    row: the first and second decoded tokens (verified drafts or drawn after a rejection)
    follow transformers' marginals (chi-square below the 0.1 % critical value for 7 degrees
    of freedom), and the first draft is accepted at the model's rate for it. Drafts cost
    nothing here (a zero step-cost model), so sizing keeps them on every row despite their low
    acceptance (sizing that turns them off is test_drafters')."""
    draft = (3, 5)
    p = [4, 1, 6]
    n = 600
    reqs = [request(p, max_tokens=4, temperature=1.0, seed=s, rid=f"s{s}") for s in range(n)]
    engine, _ = make_engine(vocab8_dir, max_num_seqs=32, max_waiting=600, speculative="ngram",
                            step_cost=StepCost(ZERO, alpha=0))
    engine.scheduler.spec.propose = lambda seq: draft[: seq.params.max_tokens - len(seq.output_token_ids) - 1]  # type: ignore[method-assign]  # noqa: E501
    results = run(engine, reqs, max_steps=20000)
    outs = torch.tensor([results[(f"s{s}", 0)].token_ids for s in range(n)])  # (n, 4)

    def dist(tokens):
        return torch.softmax(reference_logits(vocab8_dir, tokens)[-1], dim=0)

    p0 = dist(p)
    p1 = sum(p0[a] * dist(p + [a]) for a in range(8))
    p2 = sum(p0[a] * dist(p + [a])[b] * dist(p + [a, b]) for a in range(8) for b in range(8))
    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    for col, probs in ((1, p1), (2, p2)):
        counts = torch.bincount(outs[:, col], minlength=8).double()
        assert _chi2(counts, probs.double()) < critical, (col, counts, probs)
    accept_rate = (outs[:, 1] == draft[0]).double().mean().item()
    assert abs(accept_rate - p1[draft[0]].item()) < 4 * (p1[draft[0]].item() / n) ** 0.5 + 0.01
    assert engine.scheduler.spec.counts.drafted > n
