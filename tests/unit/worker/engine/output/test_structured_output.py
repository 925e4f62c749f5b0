"""Structured output in the engine: masks per row in a mixed batch, over the tiny seeded Llama.

The tiny model's weights are random, so unconstrained text is noise: a valid output can only
come from the mask, and the negative control (same requests, mask off) shows the checks fail.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from kvfleet.constraint import Constraint
from kvfleet.errors import InvalidArgument
from kvfleet.worker.engine.request import FinishReason
from tests.unit.worker.engine_harness import make_engine, prompt, request, run, run_alone, run_preempting

# Finite languages: the random model completes them well within max_tokens.
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "size": {"type": "object",
                                  "properties": {"w": {"enum": [1, 2, 3]}},
                                  "required": ["w"], "additionalProperties": False}},
          "required": ["color", "ok", "size"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


def schema_constraint(schema=SCHEMA) -> Constraint:
    return Constraint("json_schema", json.dumps(schema), "json_schema")


def constrained(p, constraint, max_tokens=60, **kw):
    req = request(p, max_tokens=max_tokens, ignore_eos=False, **kw)
    return dataclasses.replace(req, constraint=constraint)


def valid_json(text: str, schema=SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_mixed_batch_rows_match_their_solo_runs(tiny_llama_dir) -> None:
    """Free and constrained rows (two different constraints) in one batch: every row gets the
    tokens it gets alone (greedy), and each constrained output matches its constraint."""
    free = [request(prompt(7, seed=40 + i), max_tokens=10) for i in range(2)]
    js = constrained(prompt(5, seed=50), schema_constraint())
    date = constrained(prompt(6, seed=51), Constraint("regex", DATE, "regex"))
    engine, _ = make_engine(tiny_llama_dir)
    together = run(engine, [free[0], js, free[1], date])
    for req in [*free, js, date]:
        assert together[(req.request_id, 0)].token_ids == run_alone(tiny_llama_dir, req).token_ids, \
            req.request_id
    out = together[(js.request_id, 0)]
    assert out.finish_reason is FinishReason.STOP and valid_json(out.text), out.text
    out = together[(date.request_id, 0)]
    assert out.finish_reason is FinishReason.STOP and re.fullmatch(DATE, out.text), out.text


def test_sampled_n3_valid_and_mask_off_is_not(tiny_llama_dir) -> None:
    """temperature 1, n=3: every sample of every constrained request validates; the same
    requests with the mask off (no constraint) produce invalid output (negative control)."""
    reqs = [constrained(prompt(6, seed=60 + i), schema_constraint(), temperature=1.0, seed=i, n=3)
            for i in range(3)]
    engine, _ = make_engine(tiny_llama_dir)
    results = run(engine, reqs)
    texts = [results[(r.request_id, i)].text for r in reqs for i in range(3)]
    assert all(valid_json(t) for t in texts), texts
    assert len(set(texts)) > 1, "seeded samples should differ"
    engine, _ = make_engine(tiny_llama_dir)
    off = run(engine, [dataclasses.replace(r, constraint=None) for r in reqs])
    assert not any(valid_json(o.text) for o in off.values())


def test_masked_logprobs_and_stop_string(tiny_llama_dir) -> None:
    """Logprobs come from the masked distribution: every top token is a digit string, and
    the final (forced) stop token has logprob 0; a stop string still ends the output."""
    engine, _ = make_engine(tiny_llama_dir)
    digits = constrained(prompt(5, seed=70), Constraint("regex", "[0-9]{6}", "regex"), logprobs=5)
    stopped = constrained(prompt(5, seed=71), Constraint("regex", "[a-c]{3}-[a-c]{3}", "regex"),
                          stop=("-",))
    results = run(engine, [digits, stopped])
    res = results[(digits.request_id, 0)]
    decode = engine.tokenizer.decode
    for lp in res.logprobs[:-1]:
        assert lp.top and all(re.fullmatch("[0-9]+", decode([t])) for t, _ in lp.top), lp.top
    assert res.logprobs[-1].logprob == pytest.approx(0.0, abs=1e-5)
    assert re.fullmatch("[0-9]{6}", res.text)
    res = results[(stopped.request_id, 0)]
    assert res.finish_reason is FinishReason.STOP and re.fullmatch("[a-c]{3}", res.text), res.text


def test_preempted_constrained_request_resumes_its_grammar(tiny_llama_dir) -> None:
    """A constrained request preempted by recompute continues from the same grammar state:
    the same tokens as alone, and a valid output."""
    reqs = [constrained(prompt(6, seed=80 + i), schema_constraint(), max_tokens=40) for i in range(3)]
    engine, _ = make_engine(tiny_llama_dir, num_blocks=12, watermark=0.0)
    results, _ = run_preempting(engine, reqs)
    for req in reqs:
        assert run_alone(tiny_llama_dir, req).token_ids == results[(req.request_id, 0)].token_ids
        assert valid_json(results[(req.request_id, 0)].text)


def test_unsatisfiable_within_max_tokens_ends_length(tiny_llama_dir) -> None:
    engine, _ = make_engine(tiny_llama_dir)
    req = constrained(prompt(5, seed=90), Constraint("regex", "[0-9]{50}", "regex"), max_tokens=4)
    res = run(engine, [req])[(req.request_id, 0)]
    assert res.finish_reason is FinishReason.LENGTH and re.fullmatch("[0-9]*", res.text)


@pytest.mark.parametrize("constraint, words", [
    (Constraint("json_schema", "{not json", "json_schema"), "not valid JSON"),
    (Constraint("json_schema", json.dumps({"type": "frob"}), "json_schema"), "does not compile"),
    (Constraint("json_schema", json.dumps({"type": "object", "if": {}}), "json_schema"),
     "keyword 'if'"),
    (Constraint("regex", "(unclosed", "regex"), "does not compile"),
    (Constraint("regex", "a" * 5000, "regex"), "exceed the limit"),
    (Constraint("grammar", 'root ::= "a" root', "grammar"), "no accepting path"),
    (Constraint("grammar", 'root ::= x\nx ::= "b" x', "grammar"), "no accepting path"),
    (Constraint("grammar", "root ::= undefined_rule", "grammar"), "does not compile"),
])
def test_bad_constraint_refused_before_compute(tiny_llama_dir, constraint, words) -> None:
    engine, rec = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidArgument, match=words) as err:
        engine.add_request(constrained(prompt(5, seed=1), constraint))
    assert err.value.field == constraint.field
    assert not engine.has_work and not rec.plans


async def test_compile_cache_shares_by_digest(tiny_llama_dir) -> None:
    """Async compiles of one schema share one compile; a later one is a cache hit."""
    import asyncio

    engine, _ = make_engine(tiny_llama_dir)
    cache = engine.grammars
    c = schema_constraint()
    a, b = await asyncio.gather(cache.compile_async(c), cache.compile_async(c))
    assert a is b and cache.stats.misses == 1
    assert await cache.compile_async(dataclasses.replace(c, field="other")) is a
    assert cache.stats.hits >= 1 and cache.stats.misses == 1
