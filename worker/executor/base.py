"""The contract between the engine and whatever runs its step plans.

An :class:`Executor` runs one :class:`~kvfleet.worker.engine.step_plan.StepPlan` per engine
step and returns the last-token logits of its chunks. Three implementations:

- :class:`~kvfleet.worker.executor.local.LocalExecutor`: one in-process model runner (tp=1);
- :class:`~kvfleet.worker.executor.tp_executor.TPExecutor`: rank 0 of a tensor-parallel rank
  group (ranks 1..T-1 in Ray actors);
- :class:`~kvfleet.worker.executor.cost_model.CostModelExecutor`: no model, a modelled step time.

The engine calls :meth:`Executor.execute` from its one thread; the adapter loader thread calls
:meth:`Executor.load_adapter` / :meth:`Executor.unload_adapter` concurrently (for a slot no
running sequence uses); the replica calls :meth:`Executor.ranks`, :meth:`Executor.ping` and
:meth:`Executor.close` from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.kv_tier.rank_tier import NoRankTier, RankTier
from kvfleet.worker.runner.lora.adapter import AdapterSpec
from kvfleet.worker.runner.model_config import ModelConfig


@dataclass(frozen=True)
class RankInfo:
    """One rank as ``Stats``/``ClusterStatus`` report it (bytes are integers)."""

    rank: int
    node_id: str
    device: str
    pid: int
    kv_bytes: int
    num_blocks: int
    weight_bytes: int


class Executor(Protocol):
    """Runs step plans over one replica's weights and paged KV cache (all its ranks).

    """

    @property
    def tier(self) -> RankTier | NoRankTier:
        """Rank 0's side of the node's host KV tier (:class:`~kvfleet.worker.kv_tier.rank_tier.
        NoRankTier`, ``enabled`` False, without one)."""
        ...

    @property
    def pausable(self) -> bool:
        """Whether this is a :class:`PausableExecutor` (layer-level yield)."""
        ...

    @property
    def config(self) -> ModelConfig:
        """The whole model's configuration (vocabulary, context length, EOS ids)."""
        ...

    @property
    def num_blocks(self) -> int:
        """KV blocks per rank (the engine's block pool never exceeds it)."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    def validate(self, plan: StepPlan) -> None:
        """Refuse a plan that would compute garbage, before any rank runs it.

        Raises:
            OutOfRange: a position beyond the model's context length.
            InvalidArgument: a token id outside the vocabulary.
            ValueError: an empty chunk, a block table that does not cover its chunk, or an
                adapter slot that holds no adapter (a scheduler bug).
        """
        ...

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Copy-on-write, then one forward over every chunk of ``plan``.

        Returns:
            float32 ``(plan.num_logit_rows, vocab_size)``: each chunk's last-token logits (a
            chunk with drafts: its last ``1 + num_draft_tokens`` tokens').

        Raises:
            OutOfRange, InvalidArgument, ValueError: see :meth:`validate` (nothing ran).
            Unavailable: the executor can no longer run steps (a rank died or hung).
        """
        ...

    def transfer_blocks(self, saves: Sequence[tuple[int, bytes]],
                        restores: Sequence[tuple[int, bytes]]) -> bool:
        """Host-tier moves before a step (``StepPlan.block_saves`` / ``block_restores``,
        ``(block, chain hash)`` pairs) on every rank: snapshot each evicted block for
        write-back, then copy each restored block's K/V from the tier into its pool block.

        Returns:
            True when every rank restored every block; False otherwise (the engine then
            recomputes those blocks; what was restored is never used). An executor without a
            tier returns ``not restores``.

        Raises:
            Unavailable: the executor can no longer run steps.
        """
        ...

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """Read a checked adapter into ``slot`` (1..max_loras) on every rank; returns once a
        plan that uses ``slot`` may run. Never delays the steps of other slots.

        Raises:
            ValueError: ``slot`` out of range (or no adapter slots at all).
            AdapterError, OSError: the adapter could not be read (no rank uses it).
            Unavailable: the executor has failed.
        """
        ...

    def unload_adapter(self, slot: int) -> None:
        """Empty ``slot`` on every rank (no running sequence may use it)."""
        ...

    def ping(self) -> None:
        """Health: returns when the executor can run steps.

        Raises:
            Unavailable: it cannot (the message names the rank that died or hung).
        """
        ...

    def ranks(self) -> list[RankInfo]:
        """Every rank's node, device, pid, KV bytes and blocks, rank 0 first (empty: the
        executor holds no weights or KV tensors)."""
        ...

    def close(self) -> None:
        """Release every rank (idempotent)."""
        ...


class PausableExecutor(Executor, Protocol):
    """An executor whose forward can stop between decoder layers and resume (layer-level
    yield, :mod:`kvfleet.worker.engine.layer_yield.nested`): the in-process one
    (:class:`~kvfleet.worker.executor.local.LocalExecutor`), the tensor-parallel one (rank 0
    broadcasts its pause decision after each layer and the ranks serve the nested step's
    calls while paused, :mod:`kvfleet.worker.executor.tp.wire`), and the cost-model executor,
    whose modelled step sleeps in per-layer slices. ``pausable`` is True."""

    def execute_pausable(self, plan: StepPlan, should_yield: Callable[[], bool] | None
                         ) -> Any:
        """:meth:`Executor.execute`, returning a paused-forward handle instead of logits when
        ``should_yield()`` (called after each layer but the last) is true.

        Raises:
            See :meth:`Executor.execute`.
        """
        ...

    def resume(self, paused: Any, should_yield: Callable[[], bool] | None = None) -> Any:
        """Continue a paused forward: its logits (as :meth:`Executor.execute`), or a new
        handle if it paused again."""
        ...
