"""The in-process executor: one :class:`ModelRunner` holding the whole model (tp=1)."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.executor.base import RankInfo
from kvfleet.worker.kv_tier.rank_tier import NO_RANK_TIER, NoRankTier, RankTier, transfer
from kvfleet.worker.runner.lora.adapter import AdapterSpec
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.model_runner import ModelRunner, PausedForward, ShouldYield


def rank_info(runner: ModelRunner, rank: int) -> RankInfo:
    """``runner``'s rank as reported: its Ray node (empty outside Ray), device, this pid,
    KV and weight bytes."""
    node = ""
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray: no node id to report
        pass
    return RankInfo(rank, node, str(runner.device), os.getpid(), runner.kv_cache.nbytes,
                    runner.num_blocks, runner.weight_nbytes())


class LocalExecutor:
    """:class:`~kvfleet.worker.executor.base.Executor` over one in-process ``runner``
    (``tier``: its host-tier side, over ``runner.kv_cache``); a
    :class:`~kvfleet.worker.executor.base.PausableExecutor`."""

    pausable = True  # layer-level yield: see PausableExecutor

    def __init__(self, runner: ModelRunner, tier: RankTier | None = None) -> None:
        self.runner = runner
        self.tier: RankTier | NoRankTier = tier if tier is not None else NO_RANK_TIER

    @property
    def config(self) -> ModelConfig:
        return self.runner.config

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def layer_groups(self) -> LayerGroups:
        return self.runner.layer_groups

    def validate(self, plan: StepPlan) -> None:
        """See :meth:`ModelRunner.validate`."""
        self.runner.validate(plan)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """See :meth:`ModelRunner.execute`: float32 ``(plan.num_logit_rows, vocab_size)``."""
        return self.runner.execute(plan)

    def execute_pausable(self, plan: StepPlan, should_yield: ShouldYield | None
                         ) -> torch.Tensor | PausedForward:
        """See :meth:`ModelRunner.execute_pausable` (the whole model is in this process, so
        a forward can stop between layers: tp = 1 only)."""
        return self.runner.execute_pausable(plan, should_yield)

    def resume(self, paused: PausedForward, should_yield: ShouldYield | None = None
               ) -> torch.Tensor | PausedForward:
        """See :meth:`ModelRunner.resume`."""
        return self.runner.resume(paused, should_yield)

    def transfer_blocks(self, saves: Sequence[tuple[int, bytes]],
                        restores: Sequence[tuple[int, bytes]]) -> bool:
        """See :meth:`~kvfleet.worker.executor.base.Executor.transfer_blocks`."""
        return transfer(self.tier, saves, restores)

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """See :meth:`ModelRunner.load_adapter`."""
        self.runner.load_adapter(slot, spec)

    def unload_adapter(self, slot: int) -> None:
        self.runner.unload_adapter(slot)

    def ping(self) -> None:
        """An in-process runner is healthy while this process runs."""

    def ranks(self) -> list[RankInfo]:
        return [rank_info(self.runner, 0)]

    def close(self) -> None:
        """Stop the tier's writer thread, then free the runner's weights and KV cache (call
        once no step runs: nothing executes after). Idempotent."""
        self.tier.close()
        self.runner.release()
