"""RankComm's always-on collective counters (CommTimes): calls and seconds per rank."""

from __future__ import annotations

import numpy as np
import torch

from kvfleet.worker.executor.tp.comm import CommTimes, RankComm
from tests.unit.worker.executor.tp.rank_threads import on_ranks


def test_counts_all_reduces_and_sends_per_rank() -> None:
    def body(comm: RankComm):
        start = comm.times.snapshot()
        t = torch.full((8,), float(comm.rank + 1))
        comm.all_reduce(t)
        comm.all_reduce(t)
        got = comm.send(np.arange(5, dtype=np.int64)) if comm.rank == 0 else comm.recv()
        return t, got, start, comm.times.snapshot()

    results, _ = on_ranks(2, body)
    for r, (t, got, start, end) in enumerate(results):
        assert torch.equal(t, torch.full((8,), 6.0))  # (1 + 2) summed twice
        assert start == CommTimes()
        spent = end.minus(start)
        assert spent.all_reduce_calls == 2 and spent.all_reduce_s > 0
        assert (spent.send_calls, spent.send_s > 0) == ((1, True) if r == 0 else (0, False))
        assert spent.send_bytes == (5 * 8 if r == 0 else 0)
    assert results[1][1].tolist() == [0, 1, 2, 3, 4]


def test_snapshot_is_a_copy() -> None:
    times = CommTimes()
    snap = times.snapshot()
    times.all_reduce_s += 1.5
    times.all_reduce_calls += 3
    assert snap == CommTimes()
    assert times.minus(snap) == CommTimes(1.5, 3, 0.0, 0, 0)
