"""``kvfleet up`` stops what it started even when its stderr is gone (``kvfleet up 2>&1 |
head``, a closed terminal): the stopping notice must not skip the clean-up."""

from __future__ import annotations

import argparse
import io
import sys
from types import SimpleNamespace

import pytest

from kvfleet.deploy import cluster_flags, launcher, up_cli


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


class _Cluster:
    stopped = 0

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def start(self) -> str:
        raise KeyboardInterrupt  # Ctrl-C (or a signal) while the cluster was starting

    def stop(self) -> None:
        type(self).stopped += 1


def test_up_stops_the_cluster_when_stderr_is_a_closed_pipe(monkeypatch) -> None:
    cfg = SimpleNamespace(replica=SimpleNamespace(drain_timeout_s=30.0))
    monkeypatch.setattr(cluster_flags, "cluster_config", lambda args: cfg)
    monkeypatch.setattr(launcher, "LocalCluster", _Cluster)
    monkeypatch.setattr(sys, "stderr", _ClosedPipe())
    with pytest.raises(KeyboardInterrupt):
        up_cli.cmd_up(argparse.Namespace(model="m"))
    assert _Cluster.stopped == 1
