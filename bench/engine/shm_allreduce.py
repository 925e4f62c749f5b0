"""All-reduce latency between 2 idle processes: gloo vs the shared-memory all-reduce
(:mod:`kvfleet.worker.executor.tp.shm_reduce`), for ``bench/engine/tp_bench.py``.

:func:`pair_latencies` starts 2 processes that time gloo and shm alternately on the same sizes
(float32 elements) and check they sum to the same bits.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import torch


def _time_calls(fn, t: torch.Tensor, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(t)
        out.append(time.perf_counter() - start)
    return out


def _rank_main(rank: int, port: int, shm_name: str, sizes: list[int], calls: int, rounds: int,
               results) -> None:
    torch.set_num_threads(1)
    from kvfleet.worker.executor.tp.comm import GroupAddress, RankComm, host_store

    store = None
    if rank == 0:
        store = host_store("127.0.0.1", 2, 60)
        port = store.port
        results.put(("port", port))
    comm = RankComm(GroupAddress("127.0.0.1", port, 2, timeout_s=60, shm_name=shm_name,
                                 shm_max_numel=max(sizes)), rank, store=store)
    shm, gloo = comm.shm.all_reduce, lambda t: comm.cpu.allreduce([t]).wait()
    comm.barrier()
    gen = torch.Generator().manual_seed(rank)
    times: dict = {}
    exact = True
    for size in sizes:
        x = torch.randn(size, generator=gen)
        a, b = x.clone(), shm(x.clone())
        gloo(a)
        exact &= bool(torch.equal(a, b))
        for _ in range(rounds):  # alternate gloo / shm blocks: a noisy neighbour hurts both
            for kind, fn in (("gloo", gloo), ("shm", shm)):
                comm.barrier()
                zeros = torch.zeros(size)  # summed in place call after call: stays finite
                times.setdefault((kind, size), []).extend(_time_calls(fn, zeros, calls))
    comm.barrier()
    results.put((rank, {f"{k}/{s}": statistics.median(v) for (k, s), v in times.items()}, exact))
    comm.barrier()


def pair_latencies(sizes: list[int], calls: int = 200, rounds: int = 3) -> dict:
    """Median seconds per all-reduce of float32 tensors of each size (elements), gloo vs shm,
    between 2 processes; ``{"gloo": {size: s}, "shm": {size: s}, "exact": bool}`` (rank 0's
    medians; ``exact``: both gave the same bits on every rank)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = f"kvf-shm-{os.getpid()}"
    r0 = ctx.Process(target=_rank_main, args=(0, 0, name, sizes, calls, rounds, q))
    r0.start()
    kind, port = q.get(timeout=120)
    r1 = ctx.Process(target=_rank_main, args=(1, port, name, sizes, calls, rounds, q))
    r1.start()
    got = [q.get(timeout=600), q.get(timeout=600)]
    for p in (r0, r1):
        p.join(60)
    rank0 = next(g for g in got if g[0] == 0)[1]
    out: dict = {"gloo": {}, "shm": {}, "exact": all(g[2] for g in got)}
    for key, v in rank0.items():
        k, s = key.split("/")
        out[k][int(s)] = v
    return out
