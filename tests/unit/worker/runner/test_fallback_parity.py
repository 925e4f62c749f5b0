"""The transformers fallback (``--model-impl transformers``) on architectures with no native
family (OLMo 2, Granite): the engine's logits on every cache path equal transformers' own
full-prefix forward within fp32 noise (``scaled_error <= 1``, see paged_driver) — token by
token, uneven chunks in mixed batches, prefix hits (full and mid-block), copy-on-write for
n=2 siblings, preemption and recompute — at tp=1, and sharded by the class's
``base_model_tp_plan`` at tp=2. On a native family (Llama) it gives the native tokens."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from kvfleet.worker.runner.fallback.check import kv_split
from kvfleet.worker.runner.kv_cache import kv_bytes_per_block
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.fixtures.fallback_models import write_hf_model
from tests.unit.worker.engine_harness import (
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    run_preempting,
    seq_tokens,
)
from tests.unit.worker.executor.tp.threaded_group import prefill_plans, run_group
from tests.unit.worker.paged_driver import (
    BlockPool,
    Seq,
    decode,
    prefill,
    random_prompt,
    reference_logits,
    scaled_error,
)
from tests.unit.worker.paged_driver import reference_error as driver_error

ARCHS = ["tiny_olmo2_dir", "tiny_granite_dir"]


@functools.cache
def fallback_runner(model_dir: Path, impl: str) -> ModelRunner:
    """One runner per model per session (shared like ``paged_driver.runner_for``)."""
    return ModelRunner(model_dir, num_blocks=160, block_size=4, model_impl=impl)


def _engine(model_dir, impl: str = "auto", **scheduler):
    """An engine over ``--model-impl auto``: the fallback for OLMo 2 and Granite."""
    return make_engine(model_dir, runner=fallback_runner(Path(model_dir), impl), **scheduler)


def _check(model_dir, rec, req, res, index: int = 0) -> None:
    err = reference_error(model_dir, rec, f"{req.request_id}#{index}", seq_tokens(req, res))
    assert err <= 1, f"{req.request_id}#{index}: {err:.2f}x the tolerance"


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_picks_the_fallback_for_an_unregistered_family(request_fixture, arch) -> None:
    runner = fallback_runner(Path(request_fixture(arch)), "auto")
    assert runner.config.impl == "transformers"
    assert type(runner.model).__name__ == "TransformersCausalLM"


@pytest.mark.parametrize("arch", ARCHS)
def test_token_by_token_and_mixed_chunks(request_fixture, arch) -> None:
    model_dir = request_fixture(arch)
    engine, rec = _engine(model_dir, max_num_batched_tokens=1)
    req = request(prompt(13, seed=1), max_tokens=6)
    _check(model_dir, rec, req, run(engine, [req])[(req.request_id, 0)])
    reqs = [request(prompt(p, seed=10 + p), max_tokens=m) for p, m in ((5, 9), (23, 4), (14, 7))]
    engine, rec = _engine(model_dir, max_num_batched_tokens=11)
    results = run(engine, {0: reqs[:2], 2: reqs[2:]})
    for r in reqs:
        _check(model_dir, rec, r, results[(r.request_id, 0)])


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_copy_on_write_and_preemption(request_fixture, arch) -> None:
    model_dir = request_fixture(arch)
    engine, rec = _engine(model_dir)
    base = prompt(22, seed=3)
    first, same_16, same_18 = (request(base, max_tokens=4),
                               request(base[:16] + prompt(9, seed=4), max_tokens=5),
                               request(base[:18] + prompt(7, seed=5), max_tokens=5))
    results = run(engine, {0: [first], 8: [same_16], 16: [same_18]})
    assert [results[(r.request_id, 0)].last.usage.cached_prompt_tokens
            for r in (first, same_16, same_18)] == [0, 16, 16]
    for r in (first, same_16, same_18):
        _check(model_dir, rec, r, results[(r.request_id, 0)])

    engine, rec = _engine(model_dir)
    forked = request(prompt(10, seed=30), max_tokens=7, n=2, temperature=1.0, seed=7)
    results = run(engine, [forked])
    assert len([cp for p in rec.plans for cp in p.block_copies]) == 1
    for index in (0, 1):
        _check(model_dir, rec, forked, results[(forked.request_id, index)], index)

    reqs = [request(prompt(6, seed=20 + i), max_tokens=12) for i in range(3)]
    engine, rec = _engine(model_dir, num_blocks=10, watermark=0.0)
    results, _ = run_preempting(engine, reqs)
    for r in reqs:
        _check(model_dir, rec, r, results[(r.request_id, 0)])
    alone, _ = _engine(model_dir)  # recompute after preemption: the tokens of a solo run
    assert run(alone, reqs[:1])[(reqs[0].request_id, 0)].token_ids == \
        results[(reqs[0].request_id, 0)].token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_by_the_class_plan_matches_transformers(request_fixture, arch) -> None:
    """Two ranks (threads, gloo): OLMo 2's plan gathers q/k/v (every rank caches all KV
    heads), Granite's splits them (each rank caches half)."""
    model_dir = request_fixture(arch)
    tokens = random_prompt(23, seed=11)
    logits, runners = run_group(model_dir, 2, prefill_plans(tokens, 13), model_impl="transformers")
    ref = reference_logits(model_dir, tokens)
    assert scaled_error({12: logits[0][0], 22: logits[1][0]}, ref) <= 1
    assert [r.model.holds_lm_head for r in runners] == [True, False]
    kv_heads = {"tiny_olmo2_dir": 2, "tiny_granite_dir": 1}[arch]
    assert {r.local_config.num_kv_heads for r in runners} == {kv_heads}
    # the replica sizes a rank's blocks by the heads it really caches
    split = kv_split(model_dir, runners[0].config, 2)
    assert split == 2 // kv_heads
    per_block = kv_bytes_per_block(runners[0].config, 4, torch.float32, split)
    assert {r.kv_cache.nbytes for r in runners} == {16 * per_block}
    q = runners[1].model.layers[0].self_attn.q_proj.weight
    assert q.shape[0] == runners[0].config.q_size // 2  # each rank holds half the q rows


def test_tp2_without_the_all_reduce_is_wrong(tiny_granite_dir) -> None:
    """Negative control: the sharded fallback really depends on the group's sum."""
    tokens = random_prompt(23, seed=11)
    logits, _ = run_group(tiny_granite_dir, 2, prefill_plans(tokens, 13),
                          reduce=lambda comm: (lambda t: t), model_impl="transformers")
    ref = reference_logits(tiny_granite_dir, tokens)
    assert scaled_error({12: logits[0][0], 22: logits[1][0]}, ref) > 10


def test_on_a_native_family_it_gives_the_native_tokens(tiny_llama_dir) -> None:
    reqs = [request(prompt(p, seed=40 + p), max_tokens=10) for p in (7, 19)]
    native, _ = make_engine(tiny_llama_dir)
    fallback, rec = _engine(tiny_llama_dir, "transformers")
    assert fallback_runner(Path(tiny_llama_dir), "transformers").config.impl == "transformers"
    want, got = run(native, reqs), run(fallback, reqs)
    for r in reqs:
        assert got[(r.request_id, 0)].token_ids == want[(r.request_id, 0)].token_ids
        _check(tiny_llama_dir, rec, r, got[(r.request_id, 0)])


@pytest.fixture
def request_fixture(request):
    return request.getfixturevalue


def test_bfloat16_runs_close_to_fp32(tiny_olmo2_dir) -> None:
    """Not a parity claim (bf16 has ~3 significant digits): the class loads in the runner's
    dtype and its KV cache and masks follow it."""
    runner = ModelRunner(tiny_olmo2_dir, num_blocks=16, block_size=4, dtype=torch.bfloat16,
                         model_impl="transformers")
    assert runner.kv_cache.data.dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    seq = Seq("a", random_prompt(12, seed=9), BlockPool(16, seed=9).take(5))
    prefill(runner, seq, [7, 5])
    decode(runner, seq, 3)
    assert driver_error(tiny_olmo2_dir, seq) < 500  # within 5e-2 of the logit scale


@pytest.mark.parametrize("config_cls, model_cls", [
    ("SmolLM3Config", "SmolLM3ForCausalLM"),  # RoPE skipped on every 4th layer (NoPE)
    ("CohereConfig", "CohereForCausalLM"),  # parallel attention + MLP, logits × logit_scale
])
def test_more_architectures_chunked_then_token_by_token(config_cls, model_cls, smollm2_dir,
                                                       tmp_path) -> None:
    """Beyond the two fully checked: the head is the class's own (Cohere's ``logit_scale``),
    the layers' oddities are the class's (SmolLM3's NoPE layers)."""
    model_dir = write_hf_model(tmp_path / model_cls, config_cls, model_cls, smollm2_dir, seed=23,
                               pad_token_id=0)
    runner = ModelRunner(model_dir, num_blocks=16, block_size=4, model_impl="auto")
    assert runner.config.impl == "transformers"
    seq = Seq("a", random_prompt(13, seed=12), BlockPool(16, seed=12).take(6))
    prefill(runner, seq, [5, 8])
    decode(runner, seq, 6)
    assert driver_error(model_dir, seq) <= 1
