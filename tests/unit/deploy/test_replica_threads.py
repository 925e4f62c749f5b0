"""A local replica's torch threads: the host's whole CPUs less those reserved for the router
and the token relay (``--reserved-cpus``), shared out over the replicas, never below one."""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.deploy import cli
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.deploy.launcher import replica_threads


def _cfg(*flags: str):
    return cluster_config(cli.build_parser().parse_args(["up", "--executor", "cost-model", *flags]))


@pytest.mark.parametrize("cpus, flags, threads", [
    (2, ["--replicas", "1"], 1),          # one CPU left to the router and the relay
    (16, ["--replicas", "1"], 15),
    (16, ["--replicas", "2"], 7),
    (16, ["--replicas", "2", "--reserved-cpus", "0"], 8),
    (2, ["--replicas", "1", "--reserved-cpus", "0"], 2),
    (1, ["--replicas", "1"], 1),          # nothing to spare: still one thread
    (4, ["--replicas", "8"], 1),
])
def test_threads_are_the_unreserved_cpus_shared_out(cpus, flags, threads):
    cfg = _cfg(*flags)
    assert replica_threads(cpus, cfg) == threads


def test_reserved_cpus_defaults_to_one_and_rejects_a_negative_count(capsys):
    assert _cfg().reserved_cpus == 1
    with pytest.raises(SystemExit):
        _cfg("--reserved-cpus", "-1")
    assert "--reserved-cpus" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reserved_cpus"):
        dataclasses.replace(_cfg(), reserved_cpus=-1)
