"""Fixtures shared by the worker tests."""

from __future__ import annotations

import pytest

FAMILIES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir", "tiny_llama3_dir",
            "tiny_qwen3_dir", "tiny_gemma3_dir", "tiny_phi3_dir",
            "tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_gpt_oss_dir"]


@pytest.fixture(params=FAMILIES)
def model_dir(request: pytest.FixtureRequest):
    """Each tiny checkpoint family in turn: Llama, Qwen2 (QKV bias), Mistral (sliding window),
    Llama 3.x (llama3 RoPE), Qwen3 (qk-norm), Gemma 3, Phi-3, and the mixture-of-experts
    Qwen3-MoE, Mixtral and gpt-oss (sinks, YaRN, clamped SwiGLU) (tests/fixtures/models.py)."""
    return request.getfixturevalue(request.param)
