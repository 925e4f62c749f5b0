"""The host KV tier over a quantized model: blocks written back and restored give the
logits of the dequantized weights' full recomputation."""

from __future__ import annotations

from kvfleet.worker.runner.quant.config import QuantConfig
from tests.unit.worker.engine_harness import prompt, request
from tests.unit.worker.kv_tier.tier_harness import (
    evict_then_ask_again,
    parity_error,
    restored_blocks,
    tier_engine,
)
from tests.unit.worker.runner.quant.quant_harness import dequantized_dir, quant_runner


def test_restored_blocks_of_a_quantized_model_equal_recompute(tiny_llama_dir, tmp_path) -> None:
    engine, rec, tier, store = tier_engine(tiny_llama_dir, runner=quant_runner(tiny_llama_dir, "int4"))
    base = prompt(22, seed=11)
    again = request(base + prompt(3, seed=12), max_tokens=4)
    results = evict_then_ask_again(engine, tier, base, again)
    assert restored_blocks(rec, again.request_id) == 5
    ref = dequantized_dir(tiny_llama_dir, QuantConfig("int4"), tmp_path)
    assert parity_error(ref, rec, again, results) <= 1
    store.check_invariants()
