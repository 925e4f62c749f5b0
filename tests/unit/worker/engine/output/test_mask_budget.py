"""A constrained row whose token mask takes longer than its budget to fill (one tenant's
pathological grammar) ends its own request with an error naming the budget; the rows batched
with it go on as if it were never there, and its constraint is refused from then on.

The slow fill is a fake matcher (it reports the CPU time a pathological fill would take), so
nothing here depends on the host's speed."""

from __future__ import annotations

import pytest
import torch

from kvfleet.constraint import Constraint
from kvfleet.errors import InvalidArgument
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.output.masks import RowMatcher, mask_logits
from kvfleet.worker.engine.request import FinishReason
from tests.unit.worker.engine.output.test_structured_output import (
    constrained,
    schema_constraint,
    valid_json,
)
from tests.unit.worker.engine_harness import make_engine, prompt, request, run, run_alone

DIGITS = Constraint("regex", "[0-9]{30}", "guided_regex")


class SlowFill:
    """A row matcher whose fills report ``seconds`` of CPU (the real matcher fills the mask)."""

    def __init__(self, inner: RowMatcher, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def fill(self, bitmask, row: int) -> float:
        self.inner.fill(bitmask, row)
        return self.seconds

    def accept(self, token_id: int) -> bool:
        return self.inner.accept(token_id)

    @property
    def terminated(self) -> bool:
        return self.inner.terminated


def make_slow(request_id: str, at_step: int, seconds: float):
    """An ``on_step`` hook: from step ``at_step`` on, ``request_id``'s fills are slow."""

    def hook(k: int, engine: Engine) -> None:
        if k == at_step:
            io = engine._io[f"{request_id}#0"]
            io.matcher = SlowFill(io.matcher, seconds)

    return hook


def test_a_row_over_its_mask_budget_ends_its_request_and_no_other(tiny_llama_dir):
    slow = constrained(prompt(6, seed=21), DIGITS, max_tokens=30)
    js = constrained(prompt(5, seed=22), schema_constraint())
    free = request(prompt(7, seed=23), max_tokens=12)
    engine, _ = make_engine(tiny_llama_dir)
    budget = engine.mask_budget_s
    results = run(engine, [slow, js, free], on_step=make_slow(slow.request_id, 3, 20 * budget))
    out = results[(slow.request_id, 0)]
    assert out.finish_reason is FinishReason.ERROR
    err = out.last.error
    assert isinstance(err, InvalidArgument) and err.field == "guided_regex"
    assert "--grammar-mask-budget-ms" in str(err) and "token mask" in str(err)
    assert len(out.token_ids) == 3  # steps 0-2 sampled; the slow fill at step 3 ended it
    for req in (js, free):  # the others: the same tokens as alone, and complete
        assert results[(req.request_id, 0)].token_ids == run_alone(tiny_llama_dir, req).token_ids
    assert valid_json(results[(js.request_id, 0)].text)
    # Its constraint is refused from then on, at once, on this replica.
    with pytest.raises(InvalidArgument, match="token mask"):
        engine.add_request(constrained(prompt(6, seed=24), DIGITS))


def test_every_sample_of_the_request_ends_with_it(tiny_llama_dir):
    both = constrained(prompt(6, seed=31), DIGITS, max_tokens=30, n=2, temperature=1.0, seed=3)
    engine, _ = make_engine(tiny_llama_dir)
    results = run(engine, [both], on_step=make_slow(both.request_id, 3, 20 * engine.mask_budget_s))
    assert {results[(both.request_id, i)].finish_reason for i in range(2)} == {FinishReason.ERROR}


def test_fills_within_the_budget_are_not_reported(tiny_llama_dir):
    engine, _ = make_engine(tiny_llama_dir)
    grammar = engine.grammars.compile(DIGITS)
    logits = torch.zeros(3, engine.vocab_size)
    matchers = [RowMatcher(grammar), None, SlowFill(RowMatcher(grammar), 1.0)]
    masked = mask_logits(logits, matchers, budget_s=0.5)
    assert [row for row, _ in masked.over_budget] == [2]
    assert masked.over_budget[0][1] == 1.0
    assert torch.equal(masked.logits[1], logits[1])  # the free row untouched
    assert torch.isinf(masked.logits[2]).any()  # the slow row is masked all the same
