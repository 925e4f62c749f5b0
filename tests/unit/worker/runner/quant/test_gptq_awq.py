"""GPTQ / AWQ int4 checkpoints (``qweight`` / ``qzeros`` / ``scales``), built here from a tiny
model by the formats' documented packing: repacked for ``int4`` without a float round trip
(the logits equal the float weights they encode), dequantized for ``none``, act-order
dequantized then quantized (logged); any other ``quant_method`` is refused naming it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.worker.runner.model_config import UnsupportedModel
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.sources import quantizable
from tests.unit.worker.executor.tp.threaded_group import prefill_plans
from tests.unit.worker.paged_driver import random_prompt, reference_logits, scaled_error
from tests.unit.worker.runner.quant.quant_harness import BLOCK_SIZE, dequantized_dir

TOKENS = random_prompt(17, seed=4)
GROUP = 32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8c + order[i]


def _pack_along(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int 0..15 values → int32 words of 8 along ``dim`` (nibble i = element order[i])."""
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.long)
    for i, j in enumerate(order):
        word |= v[..., j] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word)  # as int32 bits
    return word.to(torch.int32).movedim(-1, dim)


def _quantize(w: torch.Tensor, g_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit, groups by ``g_idx``: (q [out, in], scales [groups, out] fp16, zeros
    [groups, out]) and the float weights they encode."""
    out, inputs = w.shape
    groups = inputs // GROUP
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.long)
    for gi in range(groups):
        cols = w[:, g_idx == gi]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        scales[gi] = ((hi - lo) / 15).half().float()
        zeros[gi] = torch.round(-lo / scales[gi]).clamp(0, 15).long()
    s, z = scales[g_idx].t(), zeros[g_idx].t()  # [out, in]
    q = torch.round(w / s + z).clamp(0, 15).long()
    return q, scales.half(), zeros, s * (q - z)


def write_checkpoint(float_dir: Path, out: Path, method: str, act_order: bool = False) -> Path:
    """``float_dir`` as a ``method`` int4 checkpoint in ``out``; ``out / "float"`` holds the
    float weights it encodes."""
    tensors, floats = {}, {}
    for name, w in load_file(float_dir / "model.safetensors").items():
        if not quantizable(name) or "embed" in name or name == "lm_head.weight":
            tensors[name] = floats[name] = w
            continue
        inputs = w.shape[1]
        g_idx = torch.arange(inputs) // GROUP
        if act_order:
            g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs))]
        q, scales, zeros, floats[name] = _quantize(w, g_idx)
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            tensors[prefix + ".qweight"] = _pack_along(q.t(), 0)  # [in / 8, out]
            tensors[prefix + ".qzeros"] = _pack_along(zeros - 1, 1)  # stored as zero - 1
            tensors[prefix + ".g_idx"] = g_idx.to(torch.int32)
        else:
            tensors[prefix + ".qweight"] = _pack_along(q.t(), 1, AWQ_PACK_ORDER)  # [in, out / 8]
            tensors[prefix + ".qzeros"] = _pack_along(zeros, 1, AWQ_PACK_ORDER)
        tensors[prefix + ".scales"] = scales
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
         "sym": False} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
         "zero_point": True})
    for d, weights, cfg in ((out, tensors, config), (out / "float", floats, None)):
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, d / "model.safetensors")
        plain = json.loads((float_dir / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(cfg or plain))
        for f in float_dir.iterdir():
            if f.name.startswith("tokenizer") or f.suffix == ".jinja":
                shutil.copy(f, d / f.name)
    return out


def _logits(runner: ModelRunner) -> dict[int, torch.Tensor]:
    out = [runner.execute(plan) for plan in prefill_plans(TOKENS, 7)]
    return {6: out[0][0], 16: out[1][0]}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_checkpoints_are_repacked_exactly(tiny_llama_dir, tmp_path, caplog, method) -> None:
    model_dir = write_checkpoint(tiny_llama_dir, tmp_path / method, method)
    ref = reference_logits(model_dir / "float", TOKENS)
    with caplog.at_level(logging.INFO, logger="kvfleet.worker.runner.quant.checkpoint"):
        int4 = ModelRunner(model_dir, 16, BLOCK_SIZE, quantization=QuantConfig("int4"))
    assert f"{method} checkpoint: 21 weights repacked as int4 as they are, 0 dequantized" in caplog.text
    floats = load_file(model_dir / "float" / "model.safetensors")
    for i, layer in enumerate(int4.model.layers):  # the encoded weights, bit for bit
        p = f"model.layers.{i}."
        want = torch.cat([floats[p + f"self_attn.{m}_proj.weight"] for m in "qkv"])
        assert torch.equal(layer.qkv.weight.dequantize(), want)
        assert torch.equal(layer.mlp.down.weight.dequantize(), floats[p + "mlp.down_proj.weight"])
    # the float embedding and LM head are quantized at load: compare with what is served
    served = dequantized_dir(model_dir, QuantConfig("int4"), tmp_path / "served")
    assert scaled_error(_logits(int4), reference_logits(served, TOKENS)) <= 1
    plain = ModelRunner(model_dir, 16, BLOCK_SIZE)  # --quantization none: dequantized
    assert scaled_error(_logits(plain), ref) <= 1
    assert int4.weight_nbytes() < plain.weight_nbytes() / 3


def test_act_order_is_dequantized_then_quantized(tiny_llama_dir, tmp_path, caplog) -> None:
    model_dir = write_checkpoint(tiny_llama_dir, tmp_path / "gptq", "gptq", act_order=True)
    with caplog.at_level(logging.INFO, logger="kvfleet.worker.runner.quant.checkpoint"):
        runner = ModelRunner(model_dir, 16, BLOCK_SIZE, quantization=QuantConfig("int4"))
    assert "0 weights repacked as int4 as they are, 21 dequantized to float (then quantized" \
        in caplog.text
    plain = ModelRunner(model_dir, 16, BLOCK_SIZE)
    assert scaled_error(_logits(plain), reference_logits(model_dir / "float", TOKENS)) <= 1
    assert torch.isfinite(_logits(runner)[16]).all()


@pytest.mark.parametrize("qc, field", [({"quant_method": "bitsandbytes"}, "quant_method"),
                                       ({"quant_method": "fp8"}, "quant_method"),
                                       ({"quant_method": "gptq", "bits": 8}, "bits"),
                                       ({"quant_method": "awq", "version": "gemv"}, "version")])
def test_other_formats_are_refused_naming_them(tiny_llama_dir, tmp_path, qc, field) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(UnsupportedModel, match=f"quantization_config.{field}"):
        ModelRunner(d, 16, BLOCK_SIZE)
