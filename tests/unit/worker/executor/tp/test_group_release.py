"""RankGroup's release: every rank process is SIGKILLed once, however often it is released."""

from __future__ import annotations

import signal

from kvfleet.worker.executor.base import RankInfo
from kvfleet.worker.executor.tp import group as group_module
from kvfleet.worker.executor.tp.group import RankGroup, TPSettings
from kvfleet.worker.executor.tp.rank_worker import RankSpec


def test_close_after_fail_signals_no_pid_again(monkeypatch) -> None:
    """Item 21(b): ``fail`` kills rank 1's pid; a later ``close`` must not signal it again (by
    then the pid may belong to an unrelated process)."""
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(group_module.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    failures: list[str] = []
    group = RankGroup(RankSpec("unused", 2, 8, 4), TPSettings(), "r1", on_failure=failures.append)
    group.infos = [RankInfo(0, "node", "cpu", 100, 0, 8, 0), RankInfo(1, "node", "cpu", 4242, 0, 8, 0),
                   RankInfo(2, "other-node", "cpu", 77, 0, 8, 0)]
    group.fail("rank 1 (pid 4242) died")
    group.close()
    group.close()
    assert killed == [(4242, signal.SIGKILL)]  # rank 2 is on another node: Ray kills it
    assert failures == ["replica r1: tensor-parallel rank 1 (pid 4242) died"]
