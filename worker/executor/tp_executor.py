"""Rank 0's executor over a tensor-parallel rank group (tp > 1).

Each step: check the plan on rank 0 (a refused plan must never reach the other ranks), call
``step`` on ranks 1..T-1 with the plan's diff (:mod:`.tp.wire`) in one broadcast, run rank 0's
own shard of the forward (whose all-reduces meet theirs), return rank 0's logits. Between
requests a keep-alive thread calls ``barrier`` whenever nothing has been sent for a quarter of
the collective timeout, so waiting ranks never time out and a rank that hung while idle is
found too.

Layer-level yield: a ``pausable_step`` runs the same way, and after each layer but the last
rank 0 broadcasts whether it pauses there (one flag, :meth:`TPExecutor.execute_pausable`);
paused, the ranks hold their forward and serve the nested step's calls until ``resume``.

Adapters load off the step stream: rank 0 reads its share, each other rank prepares its own
beside its step loop (a slow read delays no step), and the next plan commits the slot.

A collective that raises, or a group the watchdog has failed, turns every later call into
:class:`~kvfleet.errors.Unavailable` naming the rank.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.errors import Unavailable
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.executor.base import RankInfo
from kvfleet.worker.executor.tp.group import RankGroup
from kvfleet.worker.executor.tp.rank_worker import rank_tier
from kvfleet.worker.executor.tp.wire import Commit, PlanEncoder, encode_call, encode_moves
from kvfleet.worker.kv_tier.rank_tier import NO_RANK_TIER, NoRankTier, RankTier, transfer
from kvfleet.worker.runner.lora.adapter import AdapterSpec
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.model_runner import ModelRunner, PausedForward

log = logging.getLogger(__name__)
T = TypeVar("T")


class TPExecutor:
    """:class:`~kvfleet.worker.executor.base.Executor` of rank 0 over a started
    :class:`RankGroup` (``local``: rank 0's shard, from :meth:`RankGroup.start`; with
    ``group.spec.tier`` every rank writes back and restores its own KV heads)."""

    pausable = True  # layer-level yield: rank 0 broadcasts each layer's pause decision

    def __init__(self, local: ModelRunner, group: RankGroup) -> None:
        self.local, self.group = local, group
        spec_tier = group.spec.tier
        self.tier: RankTier | NoRankTier = (
            rank_tier(group.spec, 0, local.kv_cache)
            if spec_tier is not None else NO_RANK_TIER)
        self.tensor_parallel_size = group.spec.tp
        self._lock = threading.Lock()  # one call on the ranks at a time, in plan order
        self._plans = PlanEncoder()
        self._commits: list[Commit] = []  # adapter slot changes the next step carries
        self._commits_lock = threading.Lock()
        self._prepared_ids = itertools.count(1)
        self._last_sent = time.monotonic()
        self._keepalive_s = group.settings.collective_timeout_s / 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, daemon=True,
                                        name=f"tp-keepalive-{group.name}")
        self._thread.start()

    @property
    def config(self) -> ModelConfig:
        return self.local.config

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def layer_groups(self) -> LayerGroups:
        return self.local.layer_groups

    def validate(self, plan: StepPlan) -> None:
        """Rank 0's check of ``plan`` (see :meth:`ModelRunner.validate`)."""
        self.local.validate(plan)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """One step on every rank. Returns rank 0's last-token logits ``(chunks, vocab)``
        float32.

        Raises:
            OutOfRange, InvalidArgument, ValueError: the plan is refused (no rank ran it).
            Unavailable: the group has failed (a rank died or hung); the message names it.
        """
        self.local.validate(plan)

        def message() -> np.ndarray:
            with self._commits_lock:
                commits, self._commits = self._commits, []
            return encode_call("step", self._plans.encode(plan, commits))

        return self._call(message, lambda: self.local.execute(plan, validated=True))

    def execute_pausable(self, plan: StepPlan, should_yield: Callable[[], bool] | None
                         ) -> torch.Tensor | PausedForward:
        """:meth:`execute` on every rank, pausing after a layer when ``should_yield()`` (rank
        0's decision, broadcast after each layer but the last: every rank pauses there too).
        Paused, the ranks serve the calls that follow (a nested step's :meth:`transfer_blocks`
        and :meth:`execute`) until :meth:`resume`. Returns rank 0's logits or its
        :class:`PausedForward`.

        Raises:
            See :meth:`execute`.
        """
        if should_yield is None:
            return self.execute(plan)
        self.local.validate(plan)

        def message() -> np.ndarray:
            with self._commits_lock:
                commits, self._commits = self._commits, []
            return encode_call("pausable_step", self._plans.encode(plan, commits))

        return self._call(message, lambda: self.local.execute_pausable(
            plan, self._told(should_yield), validated=True))

    def resume(self, paused: PausedForward, should_yield: Callable[[], bool] | None = None
               ) -> torch.Tensor | PausedForward:
        """Continue a paused forward on every rank (it may pause again); see
        :meth:`execute_pausable`.

        Raises:
            Unavailable: the group has failed.
        """
        return self._call(lambda: encode_call("resume"),
                          lambda: self.local.resume(paused, self._told(should_yield)))

    def _told(self, should_yield: Callable[[], bool] | None) -> Callable[[], bool]:
        """``should_yield`` whose every answer is broadcast to the other ranks (they wait for
        one after each layer but the last of a pausable forward)."""
        comm = self.group.comm
        assert comm is not None, "the group is started"

        def decide() -> bool:
            pause = should_yield is not None and should_yield()
            comm.send_flag(pause)
            return pause

        return decide

    def transfer_blocks(self, saves: Sequence[tuple[int, bytes]],
                        restores: Sequence[tuple[int, bytes]]) -> bool:
        """Every rank moves its own shard of the blocks; True only if every rank restored
        every block (a sum of failures over the group). See
        :meth:`~kvfleet.worker.executor.base.Executor.transfer_blocks`.

        Raises:
            Unavailable: the group has failed.
        """
        def local() -> bool:
            ok = transfer(self.tier, saves, restores)
            assert self.group.comm is not None
            failures = self.group.comm.all_reduce(torch.tensor([0.0 if ok else 1.0]))
            return float(failures[0]) == 0.0

        return self._call(lambda: encode_call("transfer", encode_moves(saves),
                                              encode_moves(restores)), local)

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """Read ``spec`` into ``slot`` on every rank without entering the step stream: rank 0
        reads first (a bad file fails before any other rank is asked), then ranks 1..T-1 each
        prepare their share while steps keep running; the next step commits the slot on them
        before its forward (a plan that uses the slot comes after this returns).

        Raises:
            ValueError: ``slot`` out of range.
            AdapterError, OSError, ray.exceptions.RayError: a rank could not read it (the
                slot is left empty on every rank).
            Unavailable: the group has failed.
        """
        self.ping()
        self.local.load_adapter(slot, spec)
        prepared = next(self._prepared_ids)
        try:
            self.group.prepare_adapter(prepared, spec)
        except BaseException:
            self.unload_adapter(slot)
            raise
        with self._commits_lock:
            self._commits.append((slot, prepared))

    def unload_adapter(self, slot: int) -> None:
        """Empty ``slot`` on rank 0 now and on the other ranks with the next step."""
        self.local.unload_adapter(slot)
        with self._commits_lock:
            self._commits.append((slot, 0))

    def _call(self, message: Callable[[], np.ndarray], run_local: Callable[[], T]) -> T:
        """Send ``message()`` to ranks 1..T-1 (built under the lock: plans diff in send
        order), then ``run_local()`` here; a collective that fails fails the group."""
        with self._lock:
            self.ping()
            comm = self.group.comm
            assert comm is not None, "the group is started"
            self.group.step_started = time.monotonic()
            try:
                comm.send(message())
                return run_local()
            except Exception as exc:  # a collective failed: a peer died, hung or was killed
                if self.group.failure is None:
                    self.group.fail(self.group.diagnose(exc))
                raise Unavailable(self.group.failure or str(exc)) from exc
            finally:
                self.group.step_started = None
                self._last_sent = time.monotonic()

    def _keepalive(self) -> None:
        while not self._stop.wait(self._keepalive_s / 4):
            if self.group.failure is not None:
                return
            if time.monotonic() - self._last_sent < self._keepalive_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a step is running: that is traffic enough
            self._lock.release()
            try:
                self._call(lambda: encode_call("barrier"), self._barrier)
            except Unavailable:
                return

    def _barrier(self) -> None:
        assert self.group.comm is not None
        self.group.comm.barrier()

    def ping(self) -> None:
        """Raises :class:`Unavailable` naming the rank once the group has failed."""
        if self.group.failure is not None:
            raise Unavailable(self.group.failure)

    def ranks(self) -> list[RankInfo]:
        """Every rank's node, device, pid, KV bytes and blocks (rank 0 first)."""
        return self.group.ranks()

    @property
    def failure(self) -> str | None:
        return self.group.failure

    def close(self) -> None:
        """Stop the keep-alive and release every rank, rank 0's weights and KV cache included
        (call once no step runs: nothing executes after; idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)  # a keep-alive barrier in flight ends first (bounded)
        self.group.close()
        self.tier.close()
        self.local.release()
