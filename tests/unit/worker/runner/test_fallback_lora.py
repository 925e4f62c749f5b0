"""LoRA on the transformers fallback's linears, by module name, against transformers + peft
(unmerged, fp32, ``scaled_error <= 1``): every attention and MLP projection of OLMo 2 and
Granite, token by token and chunked beside a base-model request, and sharded at tp=2 (the
update joins the row-parallel partial sum; OLMo 2's column updates land before the gather)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.model_runner import ModelRunner, Shard
from tests.fixtures.adapters import peft_logits
from tests.unit.worker import engine_harness
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.executor.tp.rank_threads import on_ranks
from tests.unit.worker.executor.tp.threaded_group import prefill_plans
from tests.unit.worker.lora_harness import IDENTITY, MAX_LORA_RANK, lora_error, preload, with_adapter
from tests.unit.worker.paged_driver import random_prompt, scaled_error

ARCHS = ["tiny_olmo2_dir", "tiny_granite_dir"]


@functools.cache
def lora_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=160, block_size=4, one_row_weights=False,
                       max_loras=2, model_impl="transformers")


@pytest.fixture
def adapter(request, adapter_factory):
    """``get(arch)``: (model dir, the ``all`` adapter), checked to move the logits."""
    def get(arch):
        model_dir = request.getfixturevalue(arch)
        path = adapter_factory(model_dir, "all")
        tokens = prompt(12, seed=70)
        moved = scaled_error(dict(enumerate(peft_logits(model_dir, None, tokens))),
                             peft_logits(model_dir, path, tokens))
        assert moved >= 100, f"the adapter moves the logits by only {moved:.1f}x the tolerance"
        return model_dir, path
    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_every_projection_token_by_token_and_chunked_beside_the_base(adapter, arch) -> None:
    model_dir, path = adapter(arch)
    runner = lora_runner(Path(model_dir))
    residency = AdapterResidency(runner, {"all": check_adapter("all", path, runner.config,
                                                               MAX_LORA_RANK)}, 2)
    engine, rec = engine_harness.make_engine(model_dir, runner=runner, adapters=residency,
                                             identity=IDENTITY, max_num_batched_tokens=7)
    preload(residency, ["all"])
    tuned = with_adapter(request(prompt(17, seed=71), max_tokens=5), "all")
    base = request(prompt(11, seed=72), max_tokens=5)
    results = run(engine, {0: [tuned, base]})
    assert {c.adapter_slot for p in rec.plans for c in p.chunks} == {0, 1}
    assert lora_error(model_dir, path, rec, tuned, results[(tuned.request_id, 0)]) <= 1
    assert lora_error(model_dir, None, rec, base, results[(base.request_id, 0)]) <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_adapter_matches_peft(adapter, arch) -> None:
    model_dir, path = adapter(arch)
    tokens = random_prompt(23, seed=11)
    plans = [dataclasses.replace(p, chunks=tuple(dataclasses.replace(c, adapter_slot=1)
                                                 for c in p.chunks))
             for p in prefill_plans(tokens, 13)]

    def rank(comm):
        runner = ModelRunner(model_dir, 16, 4, one_row_weights=False,
                             shard=Shard(2, comm.rank, comm.all_reduce), max_loras=1,
                             model_impl="transformers")
        runner.load_adapter(1, check_adapter("all", path, runner.config, MAX_LORA_RANK))
        return [runner.execute(p) for p in plans]

    results, _ = on_ranks(2, rank)
    ref = peft_logits(model_dir, path, tokens)
    assert scaled_error({12: results[0][0][0], 22: results[0][1][0]}, ref) <= 1
