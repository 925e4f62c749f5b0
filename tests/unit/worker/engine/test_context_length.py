"""One context-length rule: the router, the engine's admission and the model runner refuse
the same total with the same OutOfRange wording (kvfleet.sampling_params.check_context_length)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfleet.errors import OutOfRange
from kvfleet.router.core import RouterCore
from kvfleet.sampling_params import check_context_length
from tests.unit.worker.engine_harness import make_engine, prompt, request

PAST = r"= 257 tokens: position 256 is past the context of 256 tokens"


def test_a_total_at_the_limit_fits_one_past_it_does_not() -> None:
    check_context_length(256, 256, "prompt (250 tokens) + sampling.max_tokens (6)")
    with pytest.raises(OutOfRange, match=PAST) as exc:
        check_context_length(257, 256, "prompt (250 tokens) + sampling.max_tokens (7)",
                             field="sampling.max_tokens")
    assert exc.value.field == "sampling.max_tokens"


def test_router_and_engine_refuse_one_token_past_the_context_alike(tiny_llama_dir) -> None:
    engine, _ = make_engine(tiny_llama_dir)
    assert engine.max_model_len == 256
    engine.validate(request(prompt(250, seed=1), max_tokens=6))  # exactly full: fits
    with pytest.raises(OutOfRange, match=PAST) as engine_refusal:
        engine.validate(request(prompt(250, seed=1), max_tokens=7))
    RouterCore._check_context(SimpleNamespace(max_context=256), 250, 6)
    with pytest.raises(OutOfRange, match=PAST) as router_refusal:
        RouterCore._check_context(SimpleNamespace(max_context=256), 250, 7)
    assert str(engine_refusal.value) == str(router_refusal.value)
    assert engine_refusal.value.field == router_refusal.value.field == "sampling.max_tokens"
