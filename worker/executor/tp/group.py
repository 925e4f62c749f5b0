"""Rank 0's side of a tensor-parallel replica: starts ranks 1..T-1 as Ray actors, joins
their process group, and watches them.

Placement: one bundle per rank in a ``STRICT_PACK`` placement group (a replica's ranks share a
node), ``{"GPU": 1}`` per rank on CUDA, a small fractional CPU bundle on a CPU-only host (so
tp=4 still places on 2 cores). Rank 0 is the calling process; when it runs inside a
placement group of at least T bundles (``kvfleet up``, or Ray Serve's replica group) ranks
1..T-1 take bundles 1..T-1 of it, else the group makes its own of T-1 bundles.

Failure: a watchdog thread sees a rank's :meth:`~.rank_worker.RankWorker.serve` call end
(the actor died or its forward raised) within a quarter second, and a step that runs past
``step_timeout_s`` (a hung rank: it also stops answering pings). Either way the group kills
every rank (which also unblocks rank 0 from any collective it waits in), records a message
naming the rank, and calls ``on_failure`` once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from kvfleet.worker.executor.base import RankInfo
from kvfleet.worker.executor.local import rank_info
from kvfleet.worker.executor.tp.comm import GroupAddress, RankComm, host_store
from kvfleet.worker.executor.tp.rank_worker import RankSpec, RankWorker, build_rank_runner
from kvfleet.worker.runner.lora.adapter import AdapterSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPSettings:
    """Timeouts (seconds) and placement of a tensor-parallel group.

    ``collective_timeout_s`` bounds every collective (idle ranks are kept inside it by
    keep-alive plans every quarter of it); ``step_timeout_s``: a step that has not completed by
    then means a hung rank; ``rank_num_cpus``: Ray CPUs per rank bundle on a CPU-only host;
    ``shm_all_reduce``: on CPU, the forward's all-reduces go through shared memory
    (:mod:`.shm_reduce`; the ranks share a host under ``STRICT_PACK``), gloo otherwise.
    """

    collective_timeout_s: float = 30.0
    step_timeout_s: float = 20.0
    rank_num_cpus: float = 0.05
    start_timeout_s: float = 600.0
    # STRICT_PACK puts every rank of a replica on rank 0's node: the group meets on loopback.
    store_host: str = "127.0.0.1"
    # CPU: the forward's all-reduces through shared memory (faster than gloo for the small
    # tensors of a decode step; docs/history/tp_benchmark.md); False: gloo for everything.
    shm_all_reduce: bool = True

    def __post_init__(self) -> None:
        for name in ("collective_timeout_s", "step_timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def wait_placed(pg, what: str, timeout_s: float) -> None:
    """Wait for placement group ``pg`` to be placed.

    Raises:
        RuntimeError: not placed within ``timeout_s`` seconds; names ``what`` and the free
            resources (a group that can never place otherwise waits silently).
    """
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{what} on one node were not placed within {timeout_s:g} s "
                           f"(free now: {ray.available_resources()})") from None


class RankGroup:
    """Ranks 0..T-1 of one replica; rank 0 is this process.

    Args:
        spec: what every rank builds.
        settings: timeouts and placement.
        name: the replica's id, for messages.
        on_failure: called once, from whichever thread noticed, with the failure message.
    """

    def __init__(self, spec: RankSpec, settings: TPSettings, name: str,
                 on_failure: Callable[[str], None] = lambda msg: None) -> None:
        if spec.tp < 2:
            raise ValueError(f"a rank group needs tp >= 2, got {spec.tp}")
        self.spec, self.settings, self.name = spec, settings, name
        self.on_failure = on_failure
        self.actors: list = []
        self.infos: list[RankInfo] = []
        self.comm: Optional[RankComm] = None
        self.failure: Optional[str] = None
        self.step_started: Optional[float] = None  # monotonic start of the step in flight
        self._serving: list = []
        self._signalled: set[int] = set()  # rank pids SIGKILLed already (never twice)
        self._own_pg = None
        self._closed = threading.Event()
        self._fail_lock = threading.Lock()
        self._watchdog: Optional[threading.Thread] = None

    # ---- start -----------------------------------------------------------------------------
    def start(self):
        """Start ranks 1..T-1, build rank 0's shard here, join the group; returns rank 0's
        :class:`~kvfleet.worker.runner.model_runner.ModelRunner`.

        Raises:
            ShardingError: the model does not split over T (before any actor starts).
            RuntimeError, ray.exceptions.RayError: a rank failed to load or to join (every
                rank started is released first).
        """
        from kvfleet.worker.runner.model_config import load_model_config
        from kvfleet.worker.runner.tp.layout import check_tp

        config = load_model_config(self.spec.model_dir, self.spec.model_impl)
        if config.impl == "native":  # the fallback's plan is checked as its ranks build
            check_tp(config, self.spec.tp)
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self):
        import ray

        spec, timeout = self.spec, self.settings.start_timeout_s
        cuda = spec.device.startswith("cuda")
        strategies = self._placement(cuda)
        cls = ray.remote(RankWorker)
        env = {"OMP_WAIT_POLICY": "passive",  # an idle rank must not spin on a shared core
               **{k: v for k, v in os.environ.items() if k.startswith(("GLOO_", "NCCL_"))}}
        self.actors = [cls.options(num_cpus=0 if cuda else self.settings.rank_num_cpus,
                                   num_gpus=1 if cuda else 0, max_concurrency=3, max_restarts=0,
                                   scheduling_strategy=strategies[rank - 1],
                                   runtime_env={"env_vars": env}).remote(rank)
                       for rank in range(1, spec.tp)]
        loads = [a.load.remote(spec) for a in self.actors]
        local = spec
        if cuda:  # Ray gave rank 0 its own GPU too: cuda:0 in this process
            import torch

            torch.cuda.set_device(0)
            local = replace(spec, device="cuda:0")
        runner = build_rank_runner(local, 0, lambda t: self.comm.all_reduce(t))
        self.infos = [rank_info(runner, 0)] + ray.get(loads, timeout=timeout)
        host = self.settings.store_host
        store = host_store(host, spec.tp, timeout)
        shm = (f"kvf-tp-{os.getpid()}-{store.port}"
               if self.settings.shm_all_reduce and not cuda else None)
        addr = GroupAddress(host, store.port, spec.tp, "nccl" if cuda else "gloo",
                            self.settings.collective_timeout_s, shm_name=shm)
        joins = [a.connect.remote(addr) for a in self.actors]
        self.comm = RankComm(addr, 0, store=store, device=runner.device)
        ray.get(joins, timeout=timeout)
        self._serving = [a.serve.remote() for a in self.actors]
        self._watchdog = threading.Thread(target=self._watch, name=f"tp-watchdog-{self.name}",
                                          daemon=True)
        self._watchdog.start()
        log.info("replica %s: %d ranks joined (%s)", self.name, spec.tp, addr.backend)
        return runner

    def _placement(self, cuda: bool) -> list:
        """A scheduling strategy per rank 1..T-1 (see the module docstring)."""
        from ray.util.placement_group import (
            get_current_placement_group,
            placement_group,
        )
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp = self.spec.tp
        pg, first = get_current_placement_group(), 1
        if pg is None or pg.bundle_count < tp:
            bundle = {"GPU": 1} if cuda else {"CPU": self.settings.rank_num_cpus}
            pg = self._own_pg = placement_group([bundle] * (tp - 1), strategy="STRICT_PACK")
            first = 0
            wait_placed(pg, f"replica {self.name}: {tp - 1} rank bundles of {bundle}",
                        self.settings.start_timeout_s)
        return [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + i)
                for i in range(tp - 1)]

    # ---- watching --------------------------------------------------------------------------
    def _watch(self) -> None:
        import ray

        while not self._closed.is_set() and self.failure is None:
            ready, _ = ray.wait(self._serving, num_returns=1, timeout=0.25)
            if self._closed.is_set():
                return
            if ready:
                self.fail(self._ended(ready[0]))
                return
            started = self.step_started
            if started is not None and time.monotonic() - started > self.settings.step_timeout_s:
                hung = self._unresponsive()
                who = f"{self._names(hung)} stopped answering" if hung else "a rank"
                self.fail(f"{who}: a step did not complete within "
                          f"{self.settings.step_timeout_s:g} s (hung)")
                return

    def _ended(self, ref) -> str:
        """The failure message for a rank whose serve call ended."""
        import ray

        who = self._names([self._serving.index(ref) + 1])
        try:
            ray.get(ref, timeout=1)
            return f"{who} left the group"
        except ray.exceptions.RayActorError:
            return f"{who} died"
        except Exception as exc:
            return f"{who} failed: {type(exc).__name__}: {str(exc)[:200]}"

    def _names(self, ranks: list[int]) -> str:
        """``rank 2 (pid 4242)``, for each of ``ranks``."""
        return ", ".join(f"rank {r} (pid {self.infos[r].pid})" if r < len(self.infos)
                         else f"rank {r}" for r in ranks)

    def _unresponsive(self, timeout_s: float = 1.0) -> list[int]:
        """Ranks that do not answer a ping within ``timeout_s`` seconds."""
        import ray

        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return [i + 1 for i, r in enumerate(refs) if r not in ready]

    def diagnose(self, exc: BaseException) -> str:
        """The failure message after a collective raised ``exc`` on rank 0: the rank whose
        serve call ended or that stopped answering, if one can be found within ~2 s."""
        import ray

        ready, _ = ray.wait(self._serving, num_returns=1, timeout=2.0)
        if ready:
            return self._ended(ready[0])
        hung = self._unresponsive()
        if hung:
            return f"{self._names(hung)} stopped answering"
        return f"a collective failed: {type(exc).__name__}: {str(exc)[:200]}"

    def fail(self, message: str) -> None:
        """Mark the group failed (first message wins), kill every rank, call ``on_failure``."""
        with self._fail_lock:
            if self.failure is not None or self._closed.is_set():
                return
            self.failure = f"replica {self.name}: tensor-parallel {message}"
        log.error("%s; releasing every rank", self.failure)
        self._release()
        try:
            self.on_failure(self.failure)
        except Exception:
            log.exception("on_failure callback failed")

    def ranks(self) -> list[RankInfo]:
        """Every rank's node, device, pid and bytes (rank 0 first)."""
        return list(self.infos)

    def prepare_adapter(self, prepared: int, spec: AdapterSpec) -> None:
        """Ranks 1..T-1 each read their share of ``spec`` and hold it under id ``prepared``
        (beside the step stream: steps keep running); a later step plan commits it.

        Raises:
            AdapterError, OSError, ray.exceptions.RayError: a rank could not read it (every
                rank's prepared copy is dropped), or not within ``start_timeout_s``.
        """
        import ray

        refs = [a.prepare_adapter.remote(prepared, spec) for a in self.actors]
        try:
            ray.get(refs, timeout=self.settings.start_timeout_s)
        except BaseException:
            for a in self.actors:
                a.discard_adapter.remote(prepared)
            raise

    # ---- stop ------------------------------------------------------------------------------
    def _release(self) -> None:
        """Kill every rank actor (SIGKILL by pid too: a stopped process cannot act on Ray's
        kill request) and remove the placement group this group made. Each pid is signalled
        once: a later release (``close`` after ``fail``) must not hit a reused pid."""
        import ray

        me = self.infos[0].node_id if self.infos else None
        for pid in [i.pid for i in self.infos[1:] if i.node_id == me and i.pid not in self._signalled]:
            self._signalled.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._own_pg)
            except Exception:
                log.warning("could not remove placement group of %s", self.name)
            self._own_pg = None

    def close(self) -> None:
        """Release every rank (idempotent); no failure is reported."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._release()
