"""What rank 0's engine calls instead of a plain model runner when tp > 1.

Each step: check the plan on rank 0 (a refused plan must never reach the other ranks), send
it to ranks 1..T-1 in one broadcast, run rank 0's own shard of the forward (whose all-reduces
meet theirs), return rank 0's logits. Between requests a keep-alive thread sends a PING
(broadcast + barrier) whenever nothing has been sent for a quarter of the collective timeout,
so waiting ranks never time out and a rank that hung while idle is found too.

A collective that raises, or a group the watchdog has failed, turns every later
:meth:`execute` into :class:`~kvfleet.errors.Unavailable` naming the rank.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvfleet.errors import Unavailable
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.executor.tp.group import RankGroup
from kvfleet.worker.runner.lora.adapter import AdapterSpec
from kvfleet.worker.executor.tp.rank_worker import (LOAD_ADAPTER, PING, STEP, UNLOAD_ADAPTER,
                                                 RankInfo)
from kvfleet.worker.engine.step_plan import StepPlan

log = logging.getLogger(__name__)


class TPRunner:
    """Rank 0's runner over a started :class:`RankGroup` (``local``: rank 0's shard)."""

    def __init__(self, local: ModelRunner, group: RankGroup) -> None:
        self.local, self.group = local, group
        self.config = local.config
        self.num_blocks, self.block_size = local.num_blocks, local.block_size
        self.tensor_parallel_size = group.spec.tp
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._keepalive_s = group.settings.collective_timeout_s / 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, daemon=True,
                                        name=f"tp-keepalive-{group.name}")
        self._thread.start()

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """One step on every rank. Returns rank 0's last-token logits ``(chunks, vocab)``
        float32.

        Raises:
            OutOfRange, InvalidArgument, ValueError: the plan is refused (no rank ran it).
            Unavailable: the group has failed (a rank died or hung); the message names it.
        """
        self.local.validate(plan)
        return self._on_all((STEP, plan), lambda: self.local.execute(plan, validated=True))

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """Every rank reads its share of ``spec`` into ``slot``: rank 0 first, outside the
        group (a bad file fails here, before any rank is told), then the others, in the
        order of the step plans (a later step that uses the slot finds it loaded).

        Raises:
            AdapterError, OSError: rank 0 could not read it (no rank changed).
            Unavailable: the group has failed.
        """
        self.local.load_adapter(slot, spec)
        self._on_all((LOAD_ADAPTER, (slot, spec)), lambda: None)

    def unload_adapter(self, slot: int) -> None:
        """Empty ``slot`` on every rank."""
        self._on_all((UNLOAD_ADAPTER, slot), lambda: self.local.unload_adapter(slot))

    @property
    def lora_slots(self):
        return self.local.lora_slots

    def _on_all(self, message: tuple, run_local):
        with self._lock:
            if self.group.failure is not None:
                raise Unavailable(self.group.failure)
            self.group.step_started = time.monotonic()
            try:
                self.group.comm.send(message)
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
                self._on_all((PING, None), self.group.comm.barrier)
            except Unavailable:
                return

    def ranks(self) -> list[RankInfo]:
        """Every rank's node, device, pid, KV bytes and blocks (rank 0 first)."""
        return self.group.ranks()

    @property
    def failure(self) -> str | None:
        return self.group.failure

    def close(self) -> None:
        """Stop the keep-alive and release every rank (idempotent)."""
        self._stop.set()
        self.group.close()
