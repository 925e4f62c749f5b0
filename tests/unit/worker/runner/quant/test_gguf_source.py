"""A model directory holding the GGUF it was prepared from serves that GGUF's quantized
blocks as they are: the logits equal the directory's own float weights' (which are those
blocks dequantized), Q/K row order is recovered, and tensors of other types or that do not
match are quantized from their floats, saying so in the log."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.gguf_source import _llama_rows
from kvfleet.worker.runner.quant.tensor import QuantTensor
from tests.unit.worker.executor.tp.threaded_group import prefill_plans
from tests.unit.worker.paged_driver import random_prompt, reference_logits, scaled_error
from tests.unit.worker.runner.quant.quant_harness import BLOCK_SIZE, dequantized_dir

TOKENS = random_prompt(19, seed=3)


def write_gguf_model(float_dir: Path, out: Path, qtype: str, table_qtype: str = "Q8_0") -> Path:
    """What ``kvfleet model prepare`` makes of a GGUF: ``out/source.gguf`` holding
    ``float_dir``'s weights quantized as llama.cpp's converter writes them (Q/K rows
    permuted), and beside it the float checkpoint of those blocks dequantized."""
    config = json.loads((float_dir / "config.json").read_text())
    layers, heads, kv_heads = (config["num_hidden_layers"], config["num_attention_heads"],
                               config["num_key_value_heads"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out / "source.gguf", "llama")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    floats = {}
    for name, t in sorted(load_file(float_dir / "model.safetensors").items()):
        if t.dim() == 1:
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), t.numpy())
            floats[name] = t
            continue
        module = name.split(".")[-2]
        rows = (_llama_rows(t.shape[0], heads if module == "q_proj" else kv_heads)
                if module in ("q_proj", "k_proj") else torch.arange(t.shape[0]))
        kind = getattr(gguf.GGMLQuantizationType, table_qtype if "embed" in name else qtype)
        raw = gguf.quants.quantize(t[rows].numpy(), kind)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), raw, raw_dtype=kind)
        floats[name] = torch.from_numpy(gguf.quants.dequantize(raw, kind))[torch.argsort(rows)]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file({k: v.contiguous() for k, v in floats.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    for f in float_dir.iterdir():
        if f.suffix in (".json", ".jinja") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def _logits(runner: ModelRunner) -> dict[int, torch.Tensor]:
    out = [runner.execute(plan) for plan in prefill_plans(TOKENS, 9)]
    return {8: out[0][0], 18: out[1][0]}


@pytest.mark.parametrize("method, qtype", [("int4", "Q4_0"), ("int4", "Q4_1"), ("int8", "Q8_0")])
def test_gguf_blocks_serve_as_they_are(tiny_llama_dir, tmp_path, caplog, method, qtype) -> None:
    """Every tensor in the served bits: the logits are the directory's float weights'."""
    model_dir = write_gguf_model(tiny_llama_dir, tmp_path, qtype, table_qtype=qtype)
    with caplog.at_level(logging.INFO, logger="kvfleet.worker.runner.quant.gguf_source"):
        runner = ModelRunner(model_dir, 16, BLOCK_SIZE, quantization=QuantConfig(method))
    kept = 7 * runner.config.num_layers + 2  # 7 projections a layer, embedding, LM head
    assert f"{kept} {qtype} as they are; quantized from their float values: none" in caplog.text
    assert scaled_error(_logits(runner), reference_logits(model_dir, TOKENS)) <= 1


def test_a_table_in_other_bits_is_quantized_from_its_floats(tiny_llama_dir, tmp_path,
                                                            caplog) -> None:
    """Serving int4 from a GGUF whose embedding is Q8_0 (as SmolLM2's is): that table is
    quantized from its floats (logged); the logits are those of the weights served."""
    model_dir = write_gguf_model(tiny_llama_dir, tmp_path / "model", "Q4_1")
    with caplog.at_level(logging.INFO, logger="kvfleet.worker.runner.quant.gguf_source"):
        runner = ModelRunner(model_dir, 16, BLOCK_SIZE, quantization=QuantConfig("int4"))
    assert "1 Q8_0 (model.embed_tokens.weight)" in caplog.text
    ref = dequantized_dir(model_dir, QuantConfig("int4"), tmp_path / "ref")
    assert scaled_error(_logits(runner), reference_logits(ref, TOKENS)) <= 1


def test_blocks_that_disagree_with_the_floats_are_not_used(tiny_llama_dir, tmp_path,
                                                           caplog) -> None:
    model_dir = write_gguf_model(tiny_llama_dir, tmp_path, "Q4_0")
    weights = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name] * 1.5
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="kvfleet.worker.runner.quant.gguf_source"):
        runner = ModelRunner(model_dir, 16, BLOCK_SIZE, quantization=QuantConfig("int4"))
    assert f"{name}: the GGUF's Q4_0 blocks do not match" in caplog.text
    up = runner.model.layers[1].mlp.gate_up.weight.dequantize()[-runner.config.intermediate_size:]
    assert (up - weights[name]).abs().max() < weights[name].abs().max() / 10  # from the floats


def test_without_a_gguf_weights_are_quantized_at_load(tiny_llama_dir) -> None:
    runner = ModelRunner(tiny_llama_dir, 16, BLOCK_SIZE, quantization=QuantConfig("int4"))
    assert isinstance(runner.model.embed_tokens, QuantTensor)
    assert np.isfinite(_logits(runner)[18].numpy()).all()
