"""Quantized runners for tests, and the float checkpoint holding exactly their weights.

``dequantized_dir`` writes an HF-format fp32 checkpoint whose every quantized weight is the
quantized model's, dequantized (a tied embedding stays tied): transformers' forward on it is
the reference a quantized runner must match within fp32 accumulation error, so every
exactness helper of ``tests/unit/worker`` checks a quantized runner unchanged, given that
directory as the model to compare against.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.sources import load_rank_weights
from kvfleet.worker.runner.quant.tensor import QuantTensor
from kvfleet.worker.runner.tp.layout import shard_layout

BLOCK_SIZE = 4


def dequantized_dir(model_dir: Path, quant: QuantConfig, out: Path) -> Path:
    """The float checkpoint of ``model_dir`` served as ``quant``, written to ``out``."""
    weights = load_rank_weights(model_dir, shard_layout(load_model_config(model_dir), 1, 0),
                                None, quant)
    floats = {n: (t.packed.dequantize() if isinstance(t, QuantTensor) else t).contiguous()
              for n, t in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(floats, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


@functools.cache
def quant_runner(model_dir: Path, method: str, num_blocks: int = 160) -> ModelRunner:
    """One quantized runner per (model, method) per test session (shared like
    ``paged_driver.runner_for``: every slot a test reads was written by that test)."""
    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                       quantization=QuantConfig(method))
