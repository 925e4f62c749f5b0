"""Sampling features through the engine, each against a reference computed here from
transformers' full-prefix logits: penalties, logprobs, stop strings and stop tokens, seeded
temperature/top-k/top-p draws for n=2 siblings (reproducible whatever else is in the batch)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvfleet.worker.engine.output.sampling import make_generator
from kvfleet.worker.engine.request import FinishReason
from tests.unit.worker.engine_harness import make_engine, prompt, request, run
from tests.unit.worker.paged_driver import reference_logits

NEAR_TIE = 1e-3  # a greedy pick whose top-2 reference gap is below this may legitimately differ


def _ref_rows(model_dir, req, tokens: list[int]) -> torch.Tensor:
    """Reference logits (float64) that produced each output token: row i → output token i."""
    p = len(req.prompt_token_ids)
    return reference_logits(model_dir, tokens[:-1])[p - 1:].double()


def _penalised(logits: torch.Tensor, context: list[int], output: list[int], rep: float,
               freq: float, pres: float) -> torch.Tensor:
    out = logits.clone()
    for t in set(context):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, c in Counter(output).items():
        out[t] -= freq * c + pres
    return out


def _assert_greedy_matches(rows: torch.Tensor, chosen: list[int]) -> None:
    for i, (row, tok) in enumerate(zip(rows, chosen, strict=True)):
        top2 = row.topk(2).values
        if int(row.argmax()) != tok:
            assert top2[0] - top2[1] < NEAR_TIE and row[tok] >= top2[1], f"step {i}"


@pytest.mark.parametrize("rep, freq, pres", [(0.4, 0.0, 0.0), (1.0, -1.5, -0.5), (0.6, 1.0, -2.0)])
def test_penalties_match_the_reference(tiny_llama_dir, rep, freq, pres) -> None:
    """Each combination changes the greedy output (seen tokens pulled up or pushed down), and
    every pick is the argmax of the reference logits penalised by hand."""
    base = prompt(12, seed=60)
    req = request(base, max_tokens=16, repetition_penalty=rep, frequency_penalty=freq,
                  presence_penalty=pres)
    plain = request(base, max_tokens=16)
    engine, _ = make_engine(tiny_llama_dir)
    results = run(engine, [req, plain])
    out, plain_out = results[(req.request_id, 0)].token_ids, results[(plain.request_id, 0)].token_ids
    assert out != plain_out, "the penalties must change something for this test to mean anything"
    tokens = base + out
    rows = _ref_rows(tiny_llama_dir, req, tokens)
    pen = torch.stack([_penalised(rows[i], base + out[:i], out[:i], rep, freq, pres)
                       for i in range(len(out))])
    _assert_greedy_matches(pen, out)


def test_logprobs_are_raw_model_logprobs(tiny_llama_dir) -> None:
    req = request(prompt(9, seed=61), max_tokens=6, logprobs=5, temperature=0.7, seed=1)
    engine, _ = make_engine(tiny_llama_dir)
    res = run(engine, [req])[(req.request_id, 0)]
    assert len(res.logprobs) == 6
    ref = torch.log_softmax(_ref_rows(tiny_llama_dir, req, list(req.prompt_token_ids) + res.token_ids), dim=1)
    for i, lp in enumerate(res.logprobs):
        assert lp.token_id == res.token_ids[i]
        assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-3
        assert len(lp.top) == 5
        fifth = ref[i].topk(5).values[-1].item()
        for tok, value in lp.top:
            assert abs(value - ref[i, tok].item()) < 1e-3
            assert value >= fifth - 1e-3
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_stop_strings_and_stop_tokens(tiny_llama_dir) -> None:
    base = prompt(8, seed=62)
    engine, _ = make_engine(tiny_llama_dir)
    free = request(base, max_tokens=24)
    full = run(engine, [free])[(free.request_id, 0)]
    assert len(full.text) > 12
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    stop_tok = full.token_ids[9]
    by_string = request(base, max_tokens=24, stop=(stop, "\x00never"))
    by_token = request(base, max_tokens=24, stop_token_ids=(stop_tok,))
    results = run(engine, [by_string, by_token])
    s, t = results[(by_string.request_id, 0)], results[(by_token.request_id, 0)]
    assert s.finish_reason is FinishReason.STOP and s.text == full.text[: full.text.find(stop)]
    assert s.token_ids == full.token_ids[: len(s.token_ids)] and len(s.token_ids) < 24
    first = full.token_ids.index(stop_tok)
    assert t.finish_reason is FinishReason.STOP and t.token_ids == full.token_ids[: first + 1]


def _reference_draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    gen: torch.Generator) -> int:
    x = logits / temperature
    kth = x.topk(top_k).values[-1]
    x = torch.where(x >= kth, x, torch.tensor(float("-inf"), dtype=x.dtype))
    probs = torch.softmax(x, dim=0)
    desc = probs.sort(descending=True).values
    cut = desc[int((desc.cumsum(0) < top_p).sum())]
    probs = torch.where(probs >= cut, probs, torch.zeros_like(probs))
    cdf = (probs / probs.sum()).cumsum(0)
    u = torch.rand(1, generator=gen, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True))


def test_seeded_siblings_match_reference_draws_in_any_batch(tiny_llama_dir) -> None:
    """n=2 with temperature, top-k and top-p: sample i draws from make_generator(seed, i), one
    uniform per step, whatever else shares its steps."""
    params = dict(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    req = request(prompt(11, seed=63), max_tokens=10, n=2, **params)
    engine, _ = make_engine(tiny_llama_dir)
    alone = run(engine, [req])
    again = request(list(req.prompt_token_ids), max_tokens=10, n=2, **params)
    others = [request(prompt(n, seed=64 + n), max_tokens=7, temperature=1.0, seed=n) for n in (5, 17, 30)]
    crowded = run(engine, {0: others[:2], 2: [again], 3: others[2:]})
    streams = []
    for i in range(2):
        toks = alone[(req.request_id, i)].token_ids
        assert crowded[(again.request_id, i)].token_ids == toks
        rows = _ref_rows(tiny_llama_dir, req, list(req.prompt_token_ids) + toks)
        gen = make_generator(params["seed"], i)
        ref = [_reference_draw(rows[j], params["temperature"], params["top_k"], params["top_p"], gen)
               for j in range(len(toks))]
        assert ref == toks, f"sample {i}"
        streams.append(toks)
    assert streams[0] != streams[1]
