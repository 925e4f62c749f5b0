"""Real published config.json files of the models the reference lesson budgets.

tests/fixtures/configs/ holds them with their fields as published on the HuggingFace Hub
(meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B, google/gemma-2-27b, Qwen/Qwen2.5-32B,
deepseek-ai/DeepSeek-V3, openai-community/gpt2-xl, meta-llama/Llama-3.1-405B,
ai21labs/AI21-Jamba-1.5-Mini, mistralai/Mistral-7B-v0.1, tiiuae/falcon-7b, Qwen/Qwen3-0.6B,
google/gemma-3-1b-it, microsoft/Phi-4-mini-instruct); nothing was added by hand (the last
three were transcribed from copies of the published files: no hub access here). Where a
config omits ``layer_types``, the architecture's documented rule supplies it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.allocator.model_spec import ModelKVSpec, spec_from_config

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


def config_path(name: str) -> Path:
    return CONFIGS / f"{name}.json"


def load(name: str) -> dict:
    return json.loads(config_path(name).read_text())


def spec(name: str, **kwargs) -> ModelKVSpec:
    return spec_from_config(config_path(name), **kwargs)


@pytest.fixture
def write_config(tmp_path):
    """Write a (modified) config dict to a file and return its path."""
    def write(cfg: dict, name: str = "config.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        return path
    return write
