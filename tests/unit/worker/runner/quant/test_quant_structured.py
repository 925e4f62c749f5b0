"""Structured output over a quantized model: the mask holds a JSON schema and a regex on
int4 weights, and constrained rows in a mixed batch get the tokens they get alone."""

from __future__ import annotations

import re

from kvfleet.constraint import Constraint
from kvfleet.worker.engine.request import FinishReason
from tests.unit.worker.engine.output.test_structured_output import (
    DATE,
    constrained,
    schema_constraint,
    valid_json,
)
from tests.unit.worker.engine_harness import make_engine, prompt, request, run
from tests.unit.worker.runner.quant.quant_harness import quant_runner


def test_constraints_hold_on_quantized_weights(tiny_llama_dir) -> None:
    runner = quant_runner(tiny_llama_dir, "int4")
    free = request(prompt(7, seed=40), max_tokens=10)
    js = constrained(prompt(5, seed=50), schema_constraint())
    date = constrained(prompt(6, seed=51), Constraint("regex", DATE, "regex"))
    together = run(make_engine(tiny_llama_dir, runner=runner)[0], [free, js, date])
    for req in (free, js, date):
        alone = run(make_engine(tiny_llama_dir, runner=runner)[0], [req])
        assert together[(req.request_id, 0)].token_ids == alone[(req.request_id, 0)].token_ids
    out = together[(js.request_id, 0)]
    assert out.finish_reason is FinishReason.STOP and valid_json(out.text), out.text
    assert re.fullmatch(DATE, together[(date.request_id, 0)].text)
