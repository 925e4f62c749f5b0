"""Executes one :class:`StepPlan`: copy-on-write, one varlen forward, last-token logits.

The scheduler decides, the runner executes: it owns the weights and the paged KV cache and
keeps no per-request state between steps (everything it needs arrives in the plan).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.errors import InvalidArgument
from kvfleet.sampling_params import check_context_length
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner import attention
from kvfleet.worker.runner.kv_cache import KVCache, kv_bytes_per_block
from kvfleet.worker.runner.lora.adapter import AdapterSpec, read_adapter
from kvfleet.worker.runner.lora.layer import apply_lora
from kvfleet.worker.runner.lora.slots import LoraBatch, LoraSlots
from kvfleet.worker.runner.model_config import ModelConfig, UnsupportedModel, load_model_config
from kvfleet.worker.runner.model_impl import TRANSFORMERS
from kvfleet.worker.runner.models import build_model
from kvfleet.worker.runner.quant.config import FLOAT_WEIGHTS, QuantConfig
from kvfleet.worker.runner.quant.sources import load_rank_weights
from kvfleet.worker.runner.quant.tensor import QuantizedOpError
from kvfleet.worker.runner.tp.layout import shard_layout
from kvfleet.worker.runner.tp.linear import parallelize


@dataclass(frozen=True)
class Shard:
    """Which tensor-parallel rank a runner is, and how it sums row-parallel outputs.

    ``reduce`` takes a tensor and returns it summed over every rank (in place).
    """

    tp: int
    rank: int
    reduce: Callable[[torch.Tensor], torch.Tensor]


# The whole model on one device: a group of one rank, which has nothing to sum.
WHOLE = Shard(1, 0, lambda t: t)

# Called after each decoder layer of a pausable forward: True pauses it there.
ShouldYield = Callable[[], bool]


@dataclass
class PausedForward:
    """A forward stopped between two decoder layers (:meth:`ModelRunner.execute_pausable`):
    everything :meth:`ModelRunner.resume` needs to run layers ``next_layer..`` and the LM head.
    The KV of layers ``< next_layer`` is in ``plan``'s slots; ``hidden`` ``(T, hidden_size)``,
    ``cos``/``sin`` the model's RoPE rows (see ``CausalLM.embed``), rows in the runner's
    (adapter-sorted) order."""

    plan: StepPlan
    plan_order: torch.Tensor | None  # rows back to plan order (None: already are)
    meta: attention.AttentionMetadata | attention.GroupedMetadata
    lora: LoraBatch | None
    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    next_layer: int
    done: bool = False  # resumed already


class ModelRunner:
    """One rank's model + KV cache: the whole model, or with ``shard`` one rank's share of
    the weights and KV heads (:mod:`kvfleet.worker.runner.tp`, :mod:`kvfleet.worker.executor.tp`).

    The model is built plain from this rank's local config and weights; LoRA then wraps its
    projections (:func:`~.lora.layer.apply_lora`) and tensor parallelism its row-parallel ones
    (:func:`~.tp.linear.parallelize`), in that order.

    Args:
        model_dir: HF-format directory (``config.json``, ``*.safetensors``).
        num_blocks, block_size: KV cache geometry, in blocks and tokens per block.
        dtype: weights, activations and KV cache dtype; logits are returned as float32.
        one_row_weights: hold every projection weight a second time for steps of a few rows
            (fp32 CPU with the C kernels): see :class:`~kvfleet.worker.runner.models.linear.Linear`.
        shard: this rank of a tensor-parallel group (default: the whole model); only rank 0
            holds an LM head.
        max_loras: LoRA adapter slots (1..max_loras; see :meth:`load_adapter`).
        quantization: weight-only int8 / int4 (:mod:`kvfleet.worker.runner.quant`): every
            projection, the embedding and the LM head held packed; adapters stay float.
        layer_groups: the KV cache's layer groups (:mod:`kvfleet.allocator.layer_groups`;
            the scheduler's manager must use the same windows); None: one group of every
            layer, which keeps every block.
        model_impl: ``native``, ``transformers`` (the Hugging Face class behind the paged
            attention, :mod:`~.fallback`) or ``auto`` (:mod:`~.model_impl`).

    Raises:
        ShardingError: heads or MLP width that do not split over ``shard.tp``.
        QuantLayoutError: a quantization group size or split the weights do not allow.
        UnsupportedModel: a quantized checkpoint format, or a family whose weights cannot
            be held quantized (named).
    """

    pausable = True  # execute_pausable / resume: usable as an engine's executor with layer yield

    def __init__(self, model_dir: str | Path, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 one_row_weights: bool = True, shard: Shard = WHOLE,
                 max_loras: int = 0, quantization: QuantConfig = FLOAT_WEIGHTS,
                 model_impl: str = "native", layer_groups: LayerGroups | None = None) -> None:
        # the whole model's
        self.config: ModelConfig = load_model_config(model_dir, model_impl)
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rank = shard.rank
        self.layout = shard_layout(self.config, shard.tp, shard.rank)
        self.quantization = quantization
        self.lora_slots = LoraSlots(max_loras)
        if self.config.impl == TRANSFORMERS:
            self._build_fallback(model_dir, shard, max_loras)
        else:
            self._build_native(model_dir, shard, one_row_weights, max_loras)
        self.layer_groups = layer_groups or LayerGroups.single(self.config.num_layers)
        if self.config.impl == TRANSFORMERS and self.layer_groups.num_groups > 1:
            raise ValueError("layer groups need the native decoder (--model-impl native)")
        self.kv_cache = KVCache(self.local_config, num_blocks, block_size, dtype, self.device,
                                self.layer_groups)
        self._windows = tuple(dict.fromkeys(self.config.sliding_windows))
        self.released = False

    def _build_native(self, model_dir: str | Path, shard: Shard, one_row_weights: bool,
                      max_loras: int) -> None:
        """The family's module from this rank's weights, then LoRA, then TP wrappers."""
        self.local_config = self.layout.local_config(self.config)
        weights = load_rank_weights(model_dir, self.layout, self.dtype, self.quantization)
        try:
            self.model = build_model(self.local_config, weights, self.dtype, self.device,
                                     one_row_weights, lm_head=self.layout.holds_lm_head)
        except QuantizedOpError as exc:
            raise UnsupportedModel(f"{self.config.architecture} cannot serve --quantization "
                                   f"{self.quantization.method}: {exc}") from None
        del weights
        self._adapters = apply_lora(self.model, max_loras)
        parallelize(self.model, self.layout, shard.reduce)

    def _build_fallback(self, model_dir: str | Path, shard: Shard, max_loras: int) -> None:
        """The Hugging Face class (:mod:`.fallback`), sharded by its plan, LoRA on its linears."""
        from kvfleet.worker.runner.fallback.check import FallbackRequest, check_fallback
        from kvfleet.worker.runner.fallback.lora import apply_fallback_lora
        from kvfleet.worker.runner.fallback.model import build_fallback

        raw = json.loads((Path(model_dir) / "config.json").read_text())
        check_fallback(model_dir, self.config, raw,
                       FallbackRequest(shard.tp, self.quantization.method))
        self.model, self.local_config = build_fallback(model_dir, self.config, self.dtype,
                                                       self.device, shard.tp, shard.rank,
                                                       shard.reduce)
        self._adapters = apply_fallback_lora(self.model, max_loras)

    def release(self) -> None:
        """Free the weights, adapters and KV cache for good: a stopped replica that is still
        referenced (a test, a bench's list, a reference cycle awaiting the collector) must not
        keep its weights and KV cache. Nothing runs on this runner after. Idempotent."""
        if not self.released:
            self.released = True
            del self.model, self._adapters
            self.lora_slots = LoraSlots(0)
            self.kv_cache.release()
            self.num_blocks = 0

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """Read this rank's share of a checked adapter (:func:`~.lora.adapter.check_adapter`)
        into ``slot`` (1..max_loras). Safe while a forward that does not use ``slot`` runs.

        Raises:
            ValueError: ``slot`` out of range.
        """
        if not 1 <= slot <= self.lora_slots.max_loras:
            raise ValueError(f"adapter slot must lie in [1, {self.lora_slots.max_loras}], got {slot}")
        weights = read_adapter(spec, self.config, self.layout, self.dtype, self.device)
        if self.config.impl == TRANSFORMERS:
            self._adapters.check(weights)  # type: ignore[attr-defined]
        self.lora_slots.install(slot, weights)

    def unload_adapter(self, slot: int) -> None:
        """Empty ``slot`` (no running request may use it)."""
        self.lora_slots.clear(slot)

    def weight_nbytes(self) -> int:
        """Bytes of every weight this rank holds, each copy counted: norms, the embedding, each
        projection (packed or plain) and its one-row copy, the LM head beside a tied embedding
        (once where the two share one quantized weight)."""
        if self.released:
            return 0
        projections = list(self.model.projections())
        shared = {id(getattr(p, "weight", None)) for p in projections}
        return (sum(p.nbytes for p in self.model.parameters()
                    if id(getattr(p, "packed", p)) not in shared)
                + sum(p.held_nbytes for p in projections))

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
            raise ValueError(f"sequence {chunk.seq_id}: empty chunk")
        if not 0 <= chunk.num_draft_tokens < n:
            raise ValueError(f"sequence {chunk.seq_id}: {chunk.num_draft_tokens} drafts in a "
                             f"chunk of {n} tokens")
        last = chunk.num_computed_tokens + n - 1
        check_context_length(last + 1, self.config.max_position_embeddings,
                             f"sequence {chunk.seq_id}: {chunk.num_computed_tokens} computed "
                             f"+ {n} chunk tokens")
        if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= self.config.vocab_size:
            raise InvalidArgument(
                f"sequence {chunk.seq_id}: token_ids must lie in [0, {self.config.vocab_size})"
            )
        needed = last // self.block_size + 1
        tables = chunk.tables()
        if len(tables) != self.layer_groups.num_groups:
            raise ValueError(f"sequence {chunk.seq_id}: {len(tables)} block tables for "
                             f"{self.layer_groups.num_groups} layer groups")
        for table, window in zip(tables, self.layer_groups.windows, strict=True):
            # A sliding group may have released the blocks before the chunk's first query's
            # window: those entries are never read.
            first = 0 if window is None else max(0, chunk.num_computed_tokens - window + 1)
            used = table[first // self.block_size:needed]
            if len(table) < needed or min(used) < 0 or max(used) >= self.num_blocks:
                raise ValueError(
                    f"sequence {chunk.seq_id}: block_table must hold {needed} blocks in "
                    f"[0, {self.num_blocks}) for position {last}, got {len(table)}"
                )
        if not self.lora_slots.is_loaded(chunk.adapter_slot):
            raise ValueError(f"sequence {chunk.seq_id}: adapter slot {chunk.adapter_slot} "
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
            float32 ``(plan.num_logit_rows, vocab_size)``: each chunk's last-token logits
            (with drafts, its last ``1 + num_draft_tokens`` tokens', in order); on a
            tensor-parallel rank other than 0, ``(0, vocab_size)`` (it computes no logits).

        Raises:
            OutOfRange, InvalidArgument, ValueError: see :meth:`_check` (nothing is written then).
        """
        result = self.execute_pausable(plan, None, validated)
        assert isinstance(result, torch.Tensor)  # no should_yield: never paused
        return result

    @torch.inference_mode()
    def execute_pausable(self, plan: StepPlan, should_yield: ShouldYield | None,
                         validated: bool = False) -> torch.Tensor | PausedForward:
        """:meth:`execute`, but after each decoder layer but the last, when ``should_yield()``
        is true, stop and return a :class:`PausedForward` (layer-level yield,
        :mod:`kvfleet.worker.engine.layer_yield.nested`). Another plan may then run on slots the
        paused one does not use; :meth:`resume` finishes it. ``should_yield`` is called once
        per layer: keep it cheap.

        Raises:
            See :meth:`execute`.
        """
        assert not self.released, "execute on a released runner (its replica stopped)"
        if not validated:
            self.validate(plan)
        self.kv_cache.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32)
        slots = [c.adapter_slot for c in plan.chunks]
        if slots == sorted(slots):
            return self._start(plan, plan.chunks, None, should_yield)
        # Chunks grouped by adapter: each adapter's rows become one contiguous slice (no
        # gather/scatter in the LoRA update); every rank sorts the same plan alike.
        order = sorted(range(len(slots)), key=slots.__getitem__)
        return self._start(plan, tuple(plan.chunks[i] for i in order),
                           torch.tensor(order).argsort(), should_yield)

    def _start(self, plan: StepPlan, chunks: tuple[SeqChunk, ...],
               plan_order: torch.Tensor | None, should_yield: ShouldYield | None
               ) -> torch.Tensor | PausedForward:
        """Embed ``chunks`` (copies done, validated) and run the layers; ``plan_order``:
        indices into ``chunks`` giving the plan's row order (None: as given)."""
        meta = self._metadata(chunks)
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(c.token_ids for c in chunks)),
            dtype=torch.long, device=self.device,
        )
        lora = LoraBatch.build(self.lora_slots, [c.adapter_slot for c in chunks],
                               [len(c.token_ids) for c in chunks], self.device)
        hidden, cos, sin = self.model.embed(input_ids, meta.positions)
        return self._layers(PausedForward(plan, plan_order, meta, lora, hidden, cos, sin, 0),
                            should_yield)

    def _metadata(self, chunks: tuple[SeqChunk, ...]
                  ) -> attention.AttentionMetadata | attention.GroupedMetadata:
        """The step's attention metadata: one for one layer group keeping every block (the
        layout without groups), else one per group over that group's tables."""
        groups = self.layer_groups
        if groups.num_groups == 1 and not groups.windowed:
            return attention.build_attention_metadata(chunks, self.block_size, self._windows,
                                                      self.device, self.dtype)
        metas = tuple(attention.build_attention_metadata(
            chunks, self.block_size, (w,), self.device, self.dtype, group=g, freed_window=w)
            for g, w in enumerate(groups.windows))
        return attention.GroupedMetadata(
            metas, tuple(groups.group_of(i) for i in range(groups.num_layers)))

    @torch.inference_mode()
    def resume(self, paused: PausedForward, should_yield: ShouldYield | None = None
               ) -> torch.Tensor | PausedForward:
        """Continue ``paused`` from its next layer (it may pause again, see
        :meth:`execute_pausable`); returns its logits as :meth:`execute` would, bit for bit
        those of an unpaused forward. A handle resumes once.

        Raises:
            ValueError: ``paused`` was resumed already.
        """
        if paused.done:
            raise ValueError("this paused forward was resumed already")
        paused.done = True
        return self._layers(paused, should_yield)

    def _layers(self, f: PausedForward, should_yield: ShouldYield | None
                ) -> torch.Tensor | PausedForward:
        # The step's adapter rows are set around its own layers only: a nested step between
        # two of them sets (and clears) its own.
        with self._adapters.step(f.lora):
            hidden, nxt = self.model.run_layers(f.hidden, f.cos, f.sin, f.meta, self.kv_cache,
                                                f.next_layer, should_yield)
        if nxt < len(self.model.layers):
            return PausedForward(f.plan, f.plan_order, f.meta, f.lora, hidden, f.cos, f.sin, nxt)
        rows = f.meta.last_token_indices
        if f.plan_order is not None:
            rows = rows[f.plan_order.to(rows.device)]
        if any(c.num_draft_tokens for c in f.plan.chunks):
            rows = _draft_rows(f.plan, rows)
        return self.model.compute_logits(hidden[rows]).float().cpu()


def _draft_rows(plan: StepPlan, last: torch.Tensor) -> torch.Tensor:
    """Rows of the flat batch whose logits a plan with drafts returns, in plan order: each
    chunk's last ``1 + num_draft_tokens`` tokens (``last``: each chunk's last token's row,
    plan order)."""
    ends = last.tolist()
    rows = [r for c, end in zip(plan.chunks, ends, strict=True)
            for r in range(end - c.num_draft_tokens, end + 1)]
    return torch.tensor(rows, dtype=torch.long, device=last.device)
