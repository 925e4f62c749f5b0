"""Executes one :class:`StepPlan`: copy-on-write, one varlen forward, last-token logits.

The scheduler decides, the runner executes: it owns the weights and the paged KV cache and
keeps no per-request state between steps (everything it needs arrives in the plan).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from kvfleet.errors import InvalidArgument
from kvfleet.sampling_params import check_context_length
from kvfleet.worker.runner import attention
from kvfleet.worker.runner.kv_cache import KVCache, kv_bytes_per_block
from kvfleet.worker.runner.lora.adapter import AdapterSpec, read_adapter
from kvfleet.worker.runner.lora.slots import LoraBatch, LoraSlots
from kvfleet.worker.runner.model_config import ModelConfig, load_model_config
from kvfleet.worker.runner.models import build_model
from kvfleet.worker.runner.models.linear import Linear
from kvfleet.worker.runner.tp.layout import shard_layout
from kvfleet.worker.runner.tp.shard_weights import load_shard_weights
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner.weights import load_weights


@dataclass(frozen=True)
class Shard:
    """Which tensor-parallel rank a runner is, and how it sums row-parallel outputs.

    ``reduce`` takes a tensor and returns it summed over every rank (in place).
    """

    tp: int
    rank: int
    reduce: Callable[[torch.Tensor], torch.Tensor]


class ModelRunner:
    """One rank's model + KV cache: the whole model, or with ``shard`` one rank's share of
    the weights and KV heads (:mod:`kvfleet.worker.runner.tp`, :mod:`kvfleet.worker.executor.tp`).

    Args:
        model_dir: HF-format directory (``config.json``, ``*.safetensors``).
        num_blocks, block_size: KV cache geometry, in blocks and tokens per block.
        dtype: weights, activations and KV cache dtype; logits are returned as float32.
        one_row_weights: hold every projection weight a second time for batch-1 decode steps
            (fp32 CPU with the C kernels): see :class:`~kvfleet.worker.runner.models.linear.Linear`.
        shard: this rank of a tensor-parallel group; only rank 0 holds an LM head.
        max_loras: LoRA adapter slots (1..max_loras; see :meth:`load_adapter`).

    Raises:
        ShardingError: heads or MLP width that do not split over ``shard.tp``.
    """

    def __init__(self, model_dir: str | Path, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 one_row_weights: bool = True, shard: Optional[Shard] = None,
                 max_loras: int = 0) -> None:
        self.config: ModelConfig = load_model_config(model_dir)  # the whole model's
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rank = shard.rank if shard else 0
        self.layout = None
        if shard is None or shard.tp == 1:
            local, weights = self.config, load_weights(model_dir, dtype)
        else:
            self.layout = layout = shard_layout(self.config, shard.tp, shard.rank)
            local, weights = layout.local_config(self.config), load_shard_weights(model_dir, layout, dtype)
        self.local_config = local
        self.model = build_model(local, weights, dtype, self.device, one_row_weights,
                                 lm_head=self.rank == 0)
        del weights
        if shard is not None and shard.tp > 1:
            self.model.set_reduce(shard.reduce)
        self.kv_cache = KVCache(local, num_blocks, block_size, dtype, self.device)
        self._windows = tuple(dict.fromkeys(self.config.sliding_windows))
        self.lora_slots = LoraSlots(max_loras)

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """Read this rank's share of a checked adapter (:func:`~.lora.adapter.check_adapter`)
        into ``slot`` (1..max_loras). Safe while a forward that does not use ``slot`` runs.

        Raises:
            ValueError: ``slot`` out of range.
        """
        if not 1 <= slot <= self.lora_slots.max_loras:
            raise ValueError(f"adapter slot must lie in [1, {self.lora_slots.max_loras}], got {slot}")
        self.lora_slots.install(slot, read_adapter(spec, self.config, self.layout, self.dtype,
                                                   self.device))

    def unload_adapter(self, slot: int) -> None:
        """Empty ``slot`` (no running request may use it)."""
        self.lora_slots.clear(slot)

    def weight_nbytes(self) -> int:
        """Bytes of every weight this rank holds, each copy counted: norms, the embedding, each
        projection (packed or plain) and its one-row copy, the LM head beside a tied embedding."""
        total = sum(p.nbytes for p in self.model.parameters())
        for lin in _linears(self.model):
            total += lin.nbytes + (lin.rows.nbytes if lin.rows is not None else 0)
        return total

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
        check_context_length(last + 1, self.config.max_position_embeddings,
                             f"request {chunk.request_id}: {chunk.num_computed_tokens} computed "
                             f"+ {n} chunk tokens")
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
        if not self.lora_slots.is_loaded(chunk.adapter_slot):
            raise ValueError(f"request {chunk.request_id}: adapter slot {chunk.adapter_slot} "
                             f"holds no adapter")

    def validate(self, plan: StepPlan) -> None:
        """Check every chunk of ``plan`` (see :meth:`_check`); a tensor-parallel rank 0 calls
        this before sending the plan, so that no rank starts a forward another refuses."""
        for chunk in plan.chunks:
            self._check(chunk)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, validated: bool = False) -> torch.Tensor:
        """Run every chunk of ``plan`` in one forward (``validated``: :meth:`validate` ran).

        Performs ``plan.block_copies`` first, then writes the new tokens' K/V.

        Returns:
            float32 ``(len(plan.chunks), vocab_size)``: each chunk's last-token logits; on a
            tensor-parallel rank other than 0, ``(0, vocab_size)`` (it computes no logits).

        Raises:
            OutOfRange, InvalidArgument, ValueError: see :meth:`_check` (nothing is written then).
        """
        if not validated:
            self.validate(plan)
        self.kv_cache.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32)
        slots = [c.adapter_slot for c in plan.chunks]
        if any(slots) and slots != sorted(slots):
            # Chunks grouped by adapter: each adapter's rows become one contiguous slice (no
            # gather/scatter in the LoRA update); every rank sorts the same plan alike.
            order = sorted(range(len(slots)), key=slots.__getitem__)
            logits = self._forward(tuple(plan.chunks[i] for i in order))
            return logits if logits.shape[0] == 0 else logits[torch.tensor(order).argsort()]
        return self._forward(plan.chunks)

    def _forward(self, chunks: tuple[SeqChunk, ...]) -> torch.Tensor:
        """One forward over ``chunks`` (copies done, validated): their last-token logits."""
        meta = attention.build_attention_metadata(chunks, self.block_size, self._windows,
                                                  self.device, self.dtype)
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
            dtype=torch.long, device=self.device,
        )
        lora = LoraBatch.build(self.lora_slots, [c.adapter_slot for c in chunks],
                               [len(c.token_ids) for c in chunks], self.device)
        hidden = self.model.forward(input_ids, meta.positions, meta, self.kv_cache, lora)
        if self.rank != 0:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32)
        logits = self.model.compute_logits(hidden[meta.last_token_indices])
        return logits.float().cpu()


def _linears(model) -> list[Linear]:
    """Every :class:`~kvfleet.worker.runner.models.linear.Linear` the model holds."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, Linear)]
