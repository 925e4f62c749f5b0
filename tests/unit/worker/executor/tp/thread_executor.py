"""A :class:`TPExecutor` over ranks in threads of the test process: rank 0 here, ranks 1..T-1
each a real :class:`RankWorker` serving in its own thread over a real gloo group (no Ray).

Only the group's Ray parts are replaced (:class:`ThreadGroup`): starting actors, the watchdog
and the prepare call, which runs the rank's :meth:`RankWorker.prepare_adapter` in a thread as
Ray would beside ``serve``.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Iterator, Optional

from kvfleet.worker.executor.tp.comm import GroupAddress, RankComm, host_store
from kvfleet.worker.executor.tp.group import TPSettings
from kvfleet.worker.executor.tp.rank_worker import RankSpec, RankWorker, build_rank_runner
from kvfleet.worker.executor.tp.wire import encode_call
from kvfleet.worker.executor.tp_executor import TPExecutor


class ThreadGroup:
    """The surface of :class:`~kvfleet.worker.executor.tp.group.RankGroup` a
    :class:`TPExecutor` uses, over :class:`RankWorker` threads."""

    def __init__(self, spec: RankSpec, settings: TPSettings) -> None:
        self.spec, self.settings, self.name = spec, settings, "threads"
        self.failure: Optional[str] = None
        self.step_started: Optional[float] = None
        self.workers = [RankWorker(r, exit_on_error=False) for r in range(1, spec.tp)]
        self.served: list = []
        self.comm: Optional[RankComm] = None

    def start(self):
        store = host_store("127.0.0.1", self.spec.tp, 30)
        addr = GroupAddress("127.0.0.1", store.port, self.spec.tp,
                            timeout_s=self.settings.collective_timeout_s)

        def rank(worker: RankWorker) -> None:
            worker.load(self.spec)
            worker.connect(addr)
            self.served.append(worker.serve())

        self.threads = [threading.Thread(target=rank, args=(w,), daemon=True) for w in self.workers]
        for t in self.threads:
            t.start()
        runner = build_rank_runner(self.spec, 0, lambda t: self.comm.all_reduce(t))
        self.comm = RankComm(addr, 0, store=store)
        return runner

    def prepare_adapter(self, prepared: int, spec) -> None:
        for w in self.workers:
            w.prepare_adapter(prepared, spec)

    def fail(self, message: str) -> None:
        self.failure = self.failure or message

    def diagnose(self, exc: BaseException) -> str:
        return f"a collective failed: {exc}"

    def ranks(self) -> list:
        return []

    def close(self) -> None:
        if self.failure is None and self.comm is not None:
            self.comm.send(encode_call("stop"))
        for t in self.threads:
            t.join(30)


@contextlib.contextmanager
def thread_executor(model_dir: Path, tp: int = 2, num_blocks: int = 160, block_size: int = 4,
                    max_loras: int = 0, tier=None, layer_groups=None) -> Iterator[TPExecutor]:
    """A started :class:`TPExecutor` of ``tp`` thread ranks (``tier``: every rank's host KV
    tier store; ``layer_groups``: the KV cache's); every rank stopped on exit."""
    spec = RankSpec(str(model_dir), tp, num_blocks, block_size, one_row_weights=False,
                    max_loras=max_loras, tier=tier, layer_groups=layer_groups)
    group = ThreadGroup(spec, TPSettings(collective_timeout_s=60, step_timeout_s=60))
    executor = TPExecutor(group.start(), group)  # type: ignore[arg-type]
    try:
        yield executor
    finally:
        executor.close()
        assert group.served == ["stopped"] * (tp - 1), "a rank left its group"
