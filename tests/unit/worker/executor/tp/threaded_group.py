"""A tensor-parallel group in one process: one thread per rank, a real gloo group between them.

Exercises the sharded model code (layout, sliced weights, all-reduce) without Ray; the
integration tests run the same code in Ray rank actors through the real engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.executor.tp.comm import RankComm
from kvfleet.worker.runner.model_runner import ModelRunner, Shard
from tests.unit.worker.executor.tp.rank_threads import on_ranks

BLOCK_SIZE = 4


def prefill_plans(tokens: list[int], split: int) -> list[StepPlan]:
    """Two chunks of one request: ``tokens[:split]`` then the rest (reads the cache)."""
    table = tuple(range(0, -(-len(tokens) // BLOCK_SIZE)))[::-1]  # reversed: not contiguous
    return [StepPlan((SeqChunk("r", tuple(tokens[:split]), 0, table),)),
            StepPlan((SeqChunk("r", tuple(tokens[split:]), split, table),))]


def run_group(model_dir: Path, tp: int, plans: list[StepPlan],
              reduce: Optional[Callable[[RankComm], Callable]] = None, **runner_options
              ) -> tuple[list[torch.Tensor], list[ModelRunner]]:
    """Run ``plans`` on ``tp`` ranks; returns rank 0's logits per plan and every runner.

    ``reduce(comm)`` replaces the all-reduce a rank's model uses (negative controls);
    ``runner_options``: further :class:`ModelRunner` arguments (``quantization``).
    """
    def rank(comm: RankComm) -> tuple[ModelRunner, list[torch.Tensor]]:
        fn = reduce(comm) if reduce else comm.all_reduce
        runner = ModelRunner(model_dir, 16, BLOCK_SIZE, one_row_weights=False,
                             shard=Shard(tp, comm.rank, fn), **runner_options)
        return runner, [runner.execute(plan) for plan in plans]

    results, _ = on_ranks(tp, rank)
    return results[0][1], [runner for runner, _ in results]
