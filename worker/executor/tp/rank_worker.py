"""Ranks 1..T-1 of a tensor-parallel replica: a model shard and its KV cache, nothing else.

A rank receives each step plan from rank 0 (one broadcast per step), runs the same forward
(its all-reduces meet rank 0's) and computes no logits. It keeps no request state: block
tables, scheduling and sampling live on rank 0. Wrap with ``ray.remote`` (see
:mod:`.group`); ``max_concurrency=2`` lets :meth:`ping` answer while :meth:`serve` runs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kvfleet.worker.runner.model_runner import ModelRunner, Shard
from kvfleet.worker.executor.tp.comm import GroupAddress, RankComm

log = logging.getLogger(__name__)

# Messages rank 0 sends (the first item of each tuple).
STEP, PING, STOP = "step", "ping", "stop"
LOAD_ADAPTER, UNLOAD_ADAPTER = "load_adapter", "unload_adapter"  # payload (slot, spec) / slot


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds: the model, its KV geometry and its device."""

    model_dir: str
    tp: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype = torch.float32
    one_row_weights: bool = True
    device: str = "cpu"
    num_threads: int = 1
    max_loras: int = 0  # LoRA adapter slots (see ModelRunner.load_adapter)


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


def build_rank_runner(spec: RankSpec, rank: int, reduce) -> ModelRunner:
    """This rank's :class:`ModelRunner` (``reduce``: the group's in-place all-reduce)."""
    torch.set_num_threads(spec.num_threads)
    return ModelRunner(spec.model_dir, spec.num_blocks, spec.block_size, spec.dtype, spec.device,
                       spec.one_row_weights, shard=Shard(spec.tp, rank, reduce),
                       max_loras=spec.max_loras)


def rank_info(runner: ModelRunner, rank: int) -> RankInfo:
    node = ""
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray: no node id to report
        pass
    return RankInfo(rank, node, str(runner.device), os.getpid(), runner.kv_cache.nbytes,
                    runner.num_blocks, runner.weight_nbytes())


class RankWorker:
    """Rank ``rank`` (>= 1): :meth:`load`, then :meth:`connect`, then :meth:`serve` until
    rank 0 sends STOP."""

    def __init__(self, rank: int) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.rank = rank
        self.comm: Optional[RankComm] = None
        self.runner: Optional[ModelRunner] = None

    def load(self, spec: RankSpec) -> RankInfo:
        """Read this rank's weight slices and allocate its KV cache."""
        if spec.device == "cuda":  # Ray gave this actor one GPU: it is cuda:0 here
            torch.cuda.set_device(0)
            spec = replace(spec, device="cuda:0")
        self.runner = build_rank_runner(spec, self.rank, lambda t: self.comm.all_reduce(t))
        return rank_info(self.runner, self.rank)

    def connect(self, addr: GroupAddress) -> bool:
        """Join the group (blocks until every rank has)."""
        self.comm = RankComm(addr, self.rank, device=self.runner.device)
        return True

    def serve(self) -> str:
        """Run rank 0's plans until STOP; returns why it ended. A failed forward or
        collective raises, which rank 0's watchdog sees as this call's error; the process
        then exits a second later (a rank cut off from its group, e.g. by a hung rank 0, has
        nothing left to do and must not linger)."""
        try:
            while True:
                kind, payload = self.comm.recv()
                if kind == STEP:
                    self.runner.execute(payload, validated=True)
                elif kind == PING:
                    self.comm.barrier()
                elif kind == LOAD_ADAPTER:  # rank 0 read the same files first: they load
                    self.runner.load_adapter(*payload)
                elif kind == UNLOAD_ADAPTER:
                    self.runner.unload_adapter(payload)
                elif kind == STOP:
                    return "stopped"
        except Exception:
            log.exception("rank %d left its group; exiting", self.rank)
            threading.Timer(1.0, os._exit, (1,)).start()  # after Ray has the error
            raise

    def comm_times(self):
        """This rank's :class:`~.comm.CommTimes` so far (answers while :meth:`serve` runs)."""
        return self.comm.times.snapshot()

    def ping(self) -> int:
        """Answers while :meth:`serve` runs (a hung process does not): its pid."""
        return os.getpid()

