"""Ranks 1..T-1 of a tensor-parallel replica: a model shard and its KV cache, nothing else.

A rank runs the calls rank 0 makes on every rank (:mod:`.wire`): ``step`` runs the same
forward as rank 0, whose all-reduces meet its own, and computes no logits; ``pausable_step``
the same, held between layers while rank 0 runs a nested step (layer-level yield, the
protocol in :mod:`.wire`); ``barrier`` is the idle keep-alive; ``stop`` ends
:meth:`RankWorker.serve`. It keeps no request state: block
tables (beyond the last plan's, for the plan diff), scheduling and sampling live on rank 0.

An adapter is read off the step path: rank 0 asks each rank to :meth:`RankWorker.prepare_adapter`
(a Ray call beside :meth:`RankWorker.serve`, which keeps running steps meanwhile), then the next
step plan commits it into its slot. Wrap with ``ray.remote`` (see :mod:`.group`);
``max_concurrency=3`` lets :meth:`RankWorker.ping` and a prepare run while ``serve`` runs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
import torch

from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.worker.executor.local import rank_info
from kvfleet.worker.executor.tp.comm import GroupAddress, RankComm
from kvfleet.worker.executor.tp.wire import Commit, PlanDecoder, decode_call, decode_moves
from kvfleet.worker.kv_tier.rank_tier import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_RUN_BYTES,
    NO_RANK_TIER,
    NoRankTier,
    RankTier,
    transfer,
)
from kvfleet.worker.kv_tier.store import TierStore
from kvfleet.worker.runner.lora.adapter import AdapterSpec, read_adapter
from kvfleet.worker.runner.lora.slots import Weights as LoraWeights
from kvfleet.worker.runner.model_runner import ModelRunner, PausedForward, Shard
from kvfleet.worker.runner.quant.config import FLOAT_WEIGHTS, QuantConfig

log = logging.getLogger(__name__)


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
    tier: Optional[TierStore] = None  # the node's host KV tier (a RayTier across processes)
    tier_tag: bytes = b""  # the replica's identity digest, kept with its write-backs
    tier_queue_bytes: int = DEFAULT_MAX_PENDING_BYTES  # write-back bytes queued at once
    tier_run_bytes: int = DEFAULT_MAX_RUN_BYTES  # bytes of one put
    quantization: QuantConfig = FLOAT_WEIGHTS  # weight-only int8 / int4 (each rank its shard)
    model_impl: str = "native"  # --model-impl (kvfleet.worker.runner.model_impl)
    layer_groups: Optional[LayerGroups] = None  # the KV cache's layer groups (None: one)


def build_rank_runner(spec: RankSpec, rank: int, reduce) -> ModelRunner:
    """This rank's :class:`ModelRunner` (``reduce``: the group's in-place all-reduce)."""
    torch.set_num_threads(spec.num_threads)
    return ModelRunner(spec.model_dir, spec.num_blocks, spec.block_size, spec.dtype, spec.device,
                       spec.one_row_weights, shard=Shard(spec.tp, rank, reduce),
                       max_loras=spec.max_loras, quantization=spec.quantization,
                       model_impl=spec.model_impl,
                       layer_groups=spec.layer_groups)


def rank_tier(spec: RankSpec, rank: int, kv_cache) -> RankTier:
    """Rank ``rank``'s side of ``spec.tier`` over its ``kv_cache``."""
    assert spec.tier is not None
    return RankTier(spec.tier, rank, kv_cache, spec.tier_queue_bytes, spec.tier_tag,
                    spec.tier_run_bytes)


class RankWorker:
    """Rank ``rank`` (>= 1): :meth:`load`, then :meth:`connect`, then :meth:`serve` until
    rank 0 calls ``stop`` or the group is released (``exit_on_error``: a rank process exits
    once ``serve`` fails; off for ranks run as threads of one process)."""

    def __init__(self, rank: int, exit_on_error: bool = True) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.rank, self.exit_on_error = rank, exit_on_error
        self.comm: Optional[RankComm] = None
        self.runner: Optional[ModelRunner] = None
        self._plans = PlanDecoder()
        self._prepared: dict[int, LoraWeights] = {}  # prepared id -> this rank's adapter weights
        self._prepared_lock = threading.Lock()
        # The methods rank 0 may call (wire.METHODS), and nothing else.
        self._calls: dict[str, Callable[..., None]] = {"step": self._step, "barrier": self._barrier,
                                                       "stop": self._stop,
                                                       "transfer": self._transfer,
                                                       "pausable_step": self._pausable_step,
                                                       "resume": self._resume}
        self.tier: RankTier | NoRankTier = NO_RANK_TIER
        self._serving = False

    @property
    def _runner(self) -> ModelRunner:
        assert self.runner is not None, "load() comes first"
        return self.runner

    @property
    def _comm(self) -> RankComm:
        assert self.comm is not None, "connect() comes first"
        return self.comm

    def load(self, spec: RankSpec):
        """Read this rank's weight slices and allocate its KV cache; returns its
        :class:`~kvfleet.worker.executor.base.RankInfo`."""
        if spec.device == "cuda":  # Ray gave this actor one GPU: it is cuda:0 here
            torch.cuda.set_device(0)
            spec = replace(spec, device="cuda:0")
        self.runner = build_rank_runner(spec, self.rank, lambda t: self._comm.all_reduce(t))
        if spec.tier is not None:
            self.tier = rank_tier(spec, self.rank, self.runner.kv_cache)
        return rank_info(self.runner, self.rank)

    def connect(self, addr: GroupAddress) -> bool:
        """Join the group (blocks until every rank has)."""
        self.comm = RankComm(addr, self.rank, device=self._runner.device)
        return True

    def serve(self) -> str:
        """Run rank 0's calls until it calls ``stop``; returns ``"stopped"``. A failed forward,
        collective or a malformed message raises, which rank 0's watchdog sees as this call's
        error; the process then exits a second later (a rank cut off from its group, e.g. by a
        hung rank 0, has nothing left to do and must not linger)."""
        self._serving = True
        try:
            while self._serving:
                method, args = decode_call(self._comm.recv())
                self._calls[method](*args)
            self._runner.release()  # a thread rank's worker may outlive the group
            return "stopped"
        except Exception:
            log.exception("rank %d left its group", self.rank)
            if self.exit_on_error:
                threading.Timer(1.0, os._exit, (1,)).start()  # after Ray has the error
            raise

    def _step(self, msg: np.ndarray) -> None:
        plan, commits = self._plans.decode(msg)
        self._commit(commits)
        self._runner.execute(plan, validated=True)  # rank 0 validated it before sending

    def _pausable_step(self, msg: np.ndarray) -> None:
        """A step whose forward rank 0 may pause after any layer (its flag, broadcast after
        each): paused, this rank runs rank 0's calls (the nested step's) until ``resume``."""
        plan, commits = self._plans.decode(msg)
        self._commit(commits)
        flag = self._comm.recv_flag
        result = self._runner.execute_pausable(plan, flag, validated=True)
        while isinstance(result, PausedForward):
            while True:  # the nested step's calls, until rank 0 resumes this forward
                method, args = decode_call(self._comm.recv())
                if method == "resume":
                    break
                if method == "pausable_step":
                    raise ValueError("a pausable step inside a paused one (rank 0 nests none)")
                self._calls[method](*args)
                if not self._serving:
                    return  # stopped while paused: the paused forward is dropped
            result = self._runner.resume(result, flag)

    def _resume(self) -> None:
        raise ValueError("resume with no paused forward")

    def _barrier(self) -> None:
        self._comm.barrier()

    def _transfer(self, saves: np.ndarray, restores: np.ndarray) -> None:
        """This rank's block moves; every rank then sums its failures (rank 0 reads them)."""
        ok = transfer(self.tier, decode_moves(saves), decode_moves(restores))
        self._comm.all_reduce(torch.tensor([0.0 if ok else 1.0]))

    def _stop(self) -> None:
        self._serving = False
        self.tier.close()

    def _commit(self, commits: list[Commit]) -> None:
        for slot, prepared in commits:
            if prepared == 0:
                self._runner.unload_adapter(slot)
                continue
            with self._prepared_lock:
                weights = self._prepared.pop(prepared, None)
            if weights is None:
                raise RuntimeError(f"rank {self.rank}: adapter {prepared} committed to slot "
                                   f"{slot} was never prepared")
            self._runner.lora_slots.install(slot, weights)

    def prepare_adapter(self, prepared: int, spec: AdapterSpec) -> int:
        """Read this rank's share of ``spec`` and hold it under id ``prepared`` until a step
        commits it into a slot (runs beside :meth:`serve`; steps keep running). Returns this
        rank's pid.

        Raises:
            AdapterError, OSError: the files could not be read here.
            FailedPrecondition: the files are no longer the registered revision (this rank
                checks the digest of the bytes it read: :func:`.verified_tensors`).
        """
        r = self._runner
        weights = read_adapter(spec, r.config, r.layout, r.dtype, r.device)
        with self._prepared_lock:
            self._prepared[prepared] = weights
        return os.getpid()

    def discard_adapter(self, prepared: int) -> None:
        """Drop a prepared adapter no step will commit (another rank failed to read it)."""
        with self._prepared_lock:
            self._prepared.pop(prepared, None)

    def comm_times(self):
        """This rank's :class:`~.comm.CommTimes` so far (answers while :meth:`serve` runs)."""
        return self._comm.times.snapshot()

    def ping(self) -> int:
        """Answers while :meth:`serve` runs (a hung process does not): its pid."""
        return os.getpid()
