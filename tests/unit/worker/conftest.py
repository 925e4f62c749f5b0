"""Fixtures shared by the worker tests."""

from __future__ import annotations

import pytest

FAMILIES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir"]


@pytest.fixture(params=FAMILIES)
def model_dir(request: pytest.FixtureRequest):
    """Each tiny checkpoint family in turn: Llama, Qwen2 (QKV bias), Mistral (sliding window)."""
    return request.getfixturevalue(request.param)
