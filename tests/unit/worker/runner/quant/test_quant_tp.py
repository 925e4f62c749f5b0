"""Tensor parallelism over quantized weights: each rank packs its shard (group boundaries
respect the split) and the group's logits equal the dequantized weights' forward; a split
that cuts a group is refused, naming the sizes."""

from __future__ import annotations

import pytest

from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.packed import QuantLayoutError
from tests.unit.worker.executor.tp.threaded_group import BLOCK_SIZE, prefill_plans, run_group
from tests.unit.worker.paged_driver import random_prompt, reference_logits, scaled_error
from tests.unit.worker.runner.quant.quant_harness import dequantized_dir

TOKENS = random_prompt(23, seed=11)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_sharded_quantized_logits_match_the_dequantized_weights(tiny_llama_dir, tmp_path,
                                                                method) -> None:
    quant = QuantConfig(method)
    logits, runners = run_group(tiny_llama_dir, 2, prefill_plans(TOKENS, 13), quantization=quant)
    ref = reference_logits(dequantized_dir(tiny_llama_dir, quant, tmp_path), TOKENS)
    assert scaled_error({12: logits[0][0], 22: logits[1][0]}, ref) <= 1
    whole = ModelRunner(tiny_llama_dir, 16, BLOCK_SIZE, quantization=quant)
    layer = [r.model.layers[0] for r in runners]
    # the sharded projections hold half the packed bytes each; the embedding is replicated
    assert layer[0].mlp.gate_up.nbytes + layer[1].mlp.gate_up.nbytes == whole.model.layers[0].mlp.gate_up.nbytes
    assert runners[1].weight_nbytes() < runners[0].weight_nbytes() < whole.weight_nbytes()


def test_a_split_that_cuts_a_group_is_refused(tiny_llama_dir) -> None:
    """tp=4 leaves each rank 16 of o_proj's 64 inputs: not a whole group of 32."""
    with pytest.raises(QuantLayoutError, match=r"o_proj.*tp=4.*16 inputs.*groups of 32"):
        run_group(tiny_llama_dir, 4, prefill_plans(TOKENS, 13), quantization=QuantConfig("int4"))
