"""The same-host shared-memory all-reduce sums like gloo, on every rank, and fails fast."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from kvfleet.worker.executor.tp.comm import RankComm
from kvfleet.worker.executor.tp.shm_reduce import ShmAllReduce
from tests.unit.worker.executor.tp.rank_threads import on_ranks


def _group(world: int, body, max_numel: int = 4096) -> list:
    """``body(comm)`` on every rank of a gloo group with the shm all-reduce on."""
    out, addr = on_ranks(world, body, shm_name=f"kvf-test-{os.getpid()}-{{port}}",
                         shm_max_numel=max_numel)
    assert not Path("/dev/shm", addr.shm_name).exists()  # unlinked once every rank mapped it
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sums_bit_identically_on_every_rank_and_like_gloo(world: int) -> None:
    def body(comm: RankComm):
        assert comm.shm is not None
        gen = torch.Generator().manual_seed(comm.rank)
        xs = [torch.randn(n, generator=gen) * 10 for n in (1, 576, 4096, 3 * 1024)]
        shm = [comm.all_reduce(x.clone()) for x in xs]  # the last is > max_numel: gloo
        gloo = [x.clone() for x in xs]
        for g in gloo:
            comm.cpu.allreduce([g]).wait()
        return xs, shm, gloo

    results = _group(world, body)
    for i in range(4):
        exact = sum(r[0][i].double() for r in results)
        for xs, shm, gloo in results:
            assert torch.equal(shm[i], results[0][1][i])  # every rank: the same bits
            if world == 2:  # a + b: the same bits as gloo's
                assert torch.equal(shm[i], gloo[i])
            torch.testing.assert_close(shm[i].double(), exact, rtol=1e-6, atol=1e-5)


def test_alternating_slots_keep_rounds_apart() -> None:
    def body(comm: RankComm):
        return [comm.all_reduce(torch.full((64,), float(i * (comm.rank + 1)))).clone()
                for i in range(50)]

    for rank_out in _group(2, body):
        assert [t[0].item() for t in rank_out] == [3.0 * i for i in range(50)]


def test_a_missing_peer_times_out_and_a_dead_one_fails_at_once() -> None:
    name = f"kvf-test-alone-{os.getpid()}"
    shm = ShmAllReduce(name, 0, 2, 16, timeout_s=0.5, create=True)
    try:
        with pytest.raises(TimeoutError, match="rank 1 did not arrive within 0.5 s"):
            shm.all_reduce(torch.ones(16))
        dead = subprocess.Popen(["true"])
        dead.wait()
        shm._pids[1] = dead.pid
        shm.timeout_s = 30
        with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {dead.pid}\\) is gone"):
            shm.all_reduce(torch.ones(16))
    finally:
        shm.unlink()
