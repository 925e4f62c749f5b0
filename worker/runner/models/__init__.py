"""Model families: ``config.json`` architecture name → the module that implements it.

Adding a family is one module with ``build_model(config, weights, dtype, device)`` returning a
:class:`CausalLM`, plus one line in ``REGISTRY``. Modules are imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from kvfleet.worker.runner.model_config import ModelConfig, UnsupportedModel

if TYPE_CHECKING:
    from kvfleet.worker.runner.attention import AttentionMetadata
    from kvfleet.worker.runner.kv_cache import KVCache

# Mistral and Qwen2 differ from Llama only in what ModelConfig carries (window, QKV bias).
REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "kvfleet.worker.runner.models.llama",
    "MistralForCausalLM": "kvfleet.worker.runner.models.llama",
    "Qwen2ForCausalLM": "kvfleet.worker.runner.models.llama",
}


class CausalLM(Protocol):
    """What the model runner calls; the model knows nothing of paging beyond ``meta``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """``input_ids``/``positions`` ``(T,)`` → hidden states ``(T, hidden_size)``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(N, hidden_size)`` → logits ``(N, vocab_size)`` (final norm included)."""
        ...

    def set_reduce(self, reduce) -> None:
        """Tensor parallelism: the in-place sum over ranks after each row-parallel projection."""
        ...

    def weight_bytes_per_decode(self) -> int:
        """Bytes of weights one decode step reads (the embedding table counts one row)."""
        ...


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                dtype: torch.dtype, device: torch.device | str,
                one_row_copy: bool = False, lm_head: bool = True) -> CausalLM:
    """Instantiate the family that implements ``config.architecture`` from HF-named weights
    (``one_row_copy``: keep a second copy of each weight for batch-1 decode steps, see
    :class:`~kvfleet.worker.runner.models.linear.Linear`; ``lm_head=False``: no LM head, for a
    tensor-parallel rank that never computes logits).

    Raises:
        UnsupportedModel: no registered family for the architecture.
    """
    module_name = REGISTRY.get(config.architecture)
    if module_name is None:
        raise UnsupportedModel(
            f"architecture {config.architecture!r} is not supported ({', '.join(sorted(REGISTRY))})"
        )
    return importlib.import_module(module_name).build_model(config, weights, dtype, device,
                                                            one_row_copy, lm_head)
