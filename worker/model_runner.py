"""Executes one :class:`StepPlan`: copy-on-write, one varlen forward, last-token logits.

The scheduler decides, the runner executes: it owns the weights and the paged KV cache and
keeps no per-request state between steps (everything it needs arrives in the plan).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from kvfleet.errors import InvalidArgument, OutOfRange
from kvfleet.worker import attention
from kvfleet.worker.kv_cache import KVCache, kv_bytes_per_block
from kvfleet.worker.model_config import ModelConfig, load_model_config
from kvfleet.worker.models import build_model
from kvfleet.worker.step_plan import SeqChunk, StepPlan
from kvfleet.worker.weights import load_weights


class ModelRunner:
    """One rank's model + KV cache (tp=1).

    Args:
        model_dir: HF-format directory (``config.json``, ``*.safetensors``).
        num_blocks, block_size: KV cache geometry, in blocks and tokens per block.
        dtype: weights, activations and KV cache dtype; logits are returned as float32.
        one_row_weights: hold every projection weight a second time for batch-1 decode steps
            (fp32 CPU with the C kernels): see :class:`~kvfleet.worker.models.linear.Linear`.
    """

    def __init__(self, model_dir: str | Path, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 one_row_weights: bool = True) -> None:
        self.config: ModelConfig = load_model_config(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = build_model(self.config, load_weights(model_dir, dtype), dtype, self.device,
                                 one_row_weights)
        self.kv_cache = KVCache(self.config, num_blocks, block_size, dtype, self.device)
        self._windows = tuple(dict.fromkeys(self.config.sliding_windows))

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K + V for one block across all layers."""
        return kv_bytes_per_block(config, block_size, dtype)

    def _check(self, chunk: SeqChunk) -> None:
        """Reject a chunk that would compute garbage rather than let it run.

        Raises:
            OutOfRange: a position at or beyond ``max_position_embeddings``.
            InvalidArgument: a token id outside the vocabulary.
            ValueError: an empty chunk or a block table that does not cover it (a scheduler bug).
        """
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError(f"request {chunk.request_id}: empty chunk")
        last = chunk.num_computed_tokens + n - 1
        limit = self.config.max_position_embeddings
        if last >= limit:
            raise OutOfRange(
                f"request {chunk.request_id}: position {last} is beyond the model's context "
                f"length of {limit} tokens (max_position_embeddings)"
            )
        if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= self.config.vocab_size:
            raise InvalidArgument(
                f"request {chunk.request_id}: token_ids must lie in [0, {self.config.vocab_size})"
            )
        needed = last // self.block_size + 1
        table = chunk.block_table[:needed]
        if len(table) < needed or min(table) < 0 or max(table) >= self.num_blocks:
            raise ValueError(
                f"request {chunk.request_id}: block_table must hold {needed} blocks in "
                f"[0, {self.num_blocks}) for position {last}, got {len(chunk.block_table)}"
            )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run every chunk of ``plan`` in one forward.

        Performs ``plan.block_copies`` first, then writes the new tokens' K/V.

        Returns:
            float32 ``(len(plan.chunks), vocab_size)``: each chunk's last-token logits.

        Raises:
            OutOfRange, InvalidArgument, ValueError: see :meth:`_check` (nothing is written then).
        """
        for chunk in plan.chunks:
            self._check(chunk)
        self.kv_cache.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32)
        meta = attention.build_attention_metadata(plan.chunks, self.block_size, self._windows,
                                                  self.device, self.dtype)
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(c.token_ids for c in plan.chunks)),
            dtype=torch.long, device=self.device,
        )
        hidden = self.model.forward(input_ids, meta.positions, meta, self.kv_cache)
        logits = self.model.compute_logits(hidden[meta.last_token_indices])
        return logits.float().cpu()
