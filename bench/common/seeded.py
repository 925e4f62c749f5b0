"""Seeded random Llama checkpoints for benchmarks, built once into the kvfleet cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kvfleet.deploy.models import default_cache_dir, prepare_model


def seeded_llama_dir(name: str, shape: dict, seed: int = 0) -> Path:
    """``~/.cache/kvfleet/bench/NAME``: a transformers ``LlamaConfig(**shape)`` model with
    seed ``seed``, fp32 safetensors, SmolLM2's tokenizer files; built on first use."""
    return seeded_model_dir(name, "Llama", shape, seed)


def seeded_model_dir(name: str, family: str, shape: dict, seed: int = 0) -> Path:
    """:func:`seeded_llama_dir` for any family transformers names ``{family}Config`` /
    ``{family}ForCausalLM`` (``Qwen3``, ``Gemma3Text``/``Gemma3``, ``Phi3``…)."""
    out = default_cache_dir() / "bench" / name
    if (out / "model.safetensors").is_file():
        return out
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**shape)
    model_cls = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")
    model = model_cls(config).float().eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(prepare_model(progress=False) / file, tmp / file)
    tmp.rename(out)
    return out
