"""A tensor-parallel group in one process: one thread per rank, a real gloo group between them.

Exercises the sharded model code (layout, sliced weights, all-reduce) without Ray; the
integration tests run the same code in Ray rank actors through the real engine.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from kvfleet.worker.model_runner import ModelRunner, Shard
from kvfleet.worker.parallel.comm import GroupAddress, RankComm, host_store
from kvfleet.worker.step_plan import SeqChunk, StepPlan

BLOCK_SIZE = 4


def prefill_plans(tokens: list[int], split: int) -> list[StepPlan]:
    """Two chunks of one request: ``tokens[:split]`` then the rest (reads the cache)."""
    table = tuple(range(0, -(-len(tokens) // BLOCK_SIZE)))[::-1]  # reversed: not contiguous
    return [StepPlan((SeqChunk("r", tuple(tokens[:split]), 0, table),)),
            StepPlan((SeqChunk("r", tuple(tokens[split:]), split, table),))]


def run_group(model_dir: Path, tp: int, plans: list[StepPlan],
              reduce: Optional[Callable[[RankComm], Callable]] = None
              ) -> tuple[list[torch.Tensor], list[ModelRunner]]:
    """Run ``plans`` on ``tp`` ranks; returns rank 0's logits per plan and every runner.

    ``reduce(comm)`` replaces the all-reduce a rank's model uses (negative controls).
    """
    store = host_store("127.0.0.1", tp, 30)
    addr = GroupAddress("127.0.0.1", store.port, tp, timeout_s=30)
    runners: list[Optional[ModelRunner]] = [None] * tp
    logits: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            comm = RankComm(addr, r, store=store if r == 0 else None)
            fn = reduce(comm) if reduce else comm.all_reduce
            runner = runners[r] = ModelRunner(model_dir, 16, BLOCK_SIZE, one_row_weights=False,
                                              shard=Shard(tp, r, fn))
            for plan in plans:
                out = runner.execute(plan)
                if r == 0:
                    logits.append(out)
        except BaseException as exc:  # surfaced in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return logits, runners
