"""LoRA on a quantized base (as QLoRA serving does): adapters stay float and wrap the
quantized projections; a mixed batch (no adapter and two adapters) equals peft over the
dequantized base."""

from __future__ import annotations

import pytest

from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.linear import QuantLinear
from tests.unit.worker.engine_harness import make_engine, prompt, request, run
from tests.unit.worker.lora_harness import IDENTITY, MAX_LORA_RANK, lora_error, preload, with_adapter
from tests.unit.worker.runner.quant.quant_harness import BLOCK_SIZE, dequantized_dir


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_adapters_on_a_quantized_base(tiny_llama_dir, tiny_adapters, tmp_path, method) -> None:
    quant = QuantConfig(method)
    runner = ModelRunner(tiny_llama_dir, num_blocks=160, block_size=BLOCK_SIZE, max_loras=2,
                         quantization=quant)
    assert isinstance(runner.model.layers[0].qkv.base, QuantLinear)  # LoRA wraps it
    names = ["qv", "rs"]
    catalog = {n: check_adapter(n, tiny_adapters[n], runner.config, MAX_LORA_RANK) for n in names}
    residency = AdapterResidency(runner, catalog, 2)
    engine, rec = make_engine(tiny_llama_dir, runner=runner, adapters=residency, identity=IDENTITY)
    preload(residency, names)
    reqs = [request(prompt(9, seed=70)), with_adapter(request(prompt(11, seed=71)), "qv"),
            with_adapter(request(prompt(7, seed=72)), "rs")]
    results = run(engine, reqs)
    base = dequantized_dir(tiny_llama_dir, quant, tmp_path)
    for req, adapter in zip(reqs, [None, "qv", "rs"], strict=True):
        adapter_dir = None if adapter is None else tiny_adapters[adapter]
        assert lora_error(base, adapter_dir, rec, req, results[(req.request_id, 0)]) <= 1
