"""A quantized model on every cache path equals transformers' full-prefix forward over the
same weights dequantized (fp32 accumulation tolerance, ``scaled_error <= 1``): token by
token, uneven chunks in mixed batches, prefix hits (full and mid-block), copy-on-write for
n=2 siblings, preemption and recompute — so quantization keeps the cache invariants."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.worker.runner.quant.config import QuantConfig
from tests.unit.worker.conftest import FAMILIES
from tests.unit.worker.engine_harness import (
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    run_preempting,
    seq_tokens,
)
from tests.unit.worker.runner.quant.quant_harness import dequantized_dir, quant_runner

METHODS = ["int8", "int4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(model dir, method) → the float checkpoint of the quantized weights, made once."""
    made: dict[tuple[Path, str], Path] = {}

    def get(model_dir: Path, method: str) -> Path:
        key = (model_dir, method)
        if key not in made:
            made[key] = dequantized_dir(model_dir, QuantConfig(method),
                                        tmp_path_factory.mktemp(f"deq-{method}"))
        return made[key]
    return get


def _engine(model_dir, method, **scheduler):
    return make_engine(model_dir, runner=quant_runner(model_dir, method), **scheduler)


def _check(ref_dir, rec, req, res, index: int = 0) -> None:
    err = reference_error(ref_dir, rec, f"{req.request_id}#{index}", seq_tokens(req, res))
    assert err <= 1, f"{req.request_id}#{index}: {err:.2f}x the tolerance"


# What a family changes in quantization (which projections, fused or tied, with biases) is the
# same at either width, and what the width changes (packing, kernel) no family changes: Llama,
# Qwen2 and Mistral run both, every other family int4.
BOTH_WIDTHS = ("tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir")
FAMILY_METHODS = pytest.mark.parametrize("model_dir, method", [
    *((f, m) for f in BOTH_WIDTHS for m in METHODS),
    *((f, "int4") for f in FAMILIES if f not in BOTH_WIDTHS)], indirect=["model_dir"])


@FAMILY_METHODS
def test_token_by_token_and_mixed_chunks(model_dir, method, reference) -> None:
    """Every family (Llama; Qwen2 with QKV bias and a tied, quantized embedding; Mistral's
    sliding window; and the rest of ``FAMILIES``, MoE experts staying float): a one-token
    budget, then a mixed batch with uneven chunks."""
    ref = reference(model_dir, method)
    engine, rec = _engine(model_dir, method, max_num_batched_tokens=1)
    req = request(prompt(13, seed=1), max_tokens=6)
    _check(ref, rec, req, run(engine, [req])[(req.request_id, 0)])
    reqs = [request(prompt(p, seed=10 + p), max_tokens=m) for p, m in ((5, 9), (23, 4), (14, 7))]
    engine, rec = _engine(model_dir, method, max_num_batched_tokens=11)
    results = run(engine, {0: reqs[:2], 2: reqs[2:]})
    for r in reqs:
        _check(ref, rec, r, results[(r.request_id, 0)])


@pytest.mark.parametrize("method", METHODS)
def test_prefix_hits_copy_on_write_and_preemption(tiny_llama_dir, method, reference) -> None:
    ref = reference(tiny_llama_dir, method)
    engine, rec = _engine(tiny_llama_dir, method)
    base = prompt(22, seed=3)
    first, same_16, same_18 = (request(base, max_tokens=4),
                               request(base[:16] + prompt(9, seed=4), max_tokens=5),
                               request(base[:18] + prompt(7, seed=5), max_tokens=5))
    results = run(engine, {0: [first], 8: [same_16], 16: [same_18]})
    assert [results[(r.request_id, 0)].last.usage.cached_prompt_tokens
            for r in (first, same_16, same_18)] == [0, 16, 16]
    for r in (first, same_16, same_18):
        _check(ref, rec, r, results[(r.request_id, 0)])

    engine, rec = _engine(tiny_llama_dir, method)
    forked = request(prompt(10, seed=30), max_tokens=7, n=2, temperature=1.0, seed=7)
    results = run(engine, [forked])
    assert len([cp for p in rec.plans for cp in p.block_copies]) == 1
    for index in (0, 1):
        _check(ref, rec, forked, results[(forked.request_id, index)], index)

    reqs = [request(prompt(6, seed=20 + i), max_tokens=12) for i in range(3)]
    engine, rec = _engine(tiny_llama_dir, method, num_blocks=10, watermark=0.0)
    results, _ = run_preempting(engine, reqs)
    for r in reqs:
        res = results[(r.request_id, 0)]
        _check(ref, rec, r, res)
        alone_engine, _ = _engine(tiny_llama_dir, method)
        assert run(alone_engine, [r])[(r.request_id, 0)].token_ids == res.token_ids


def test_the_float_model_is_not_the_reference(tiny_llama_dir, reference) -> None:
    """Negative control: the quantized runner does not match the unquantized weights, so the
    checks above are not vacuous."""
    engine, rec = _engine(tiny_llama_dir, "int4")
    req = request(prompt(9, seed=8), max_tokens=3)
    res = run(engine, [req])[(req.request_id, 0)]
    assert reference_error(tiny_llama_dir, rec, f"{req.request_id}#0", seq_tokens(req, res)) > 10
