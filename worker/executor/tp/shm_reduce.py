"""A same-host all-reduce through shared memory, for ranks that all run on one CPU host.

What vLLM's CPU backend and DeepSpeed do in C++, here in numpy: each rank copies its tensor
into its own slot of one shared segment, publishes the call's round number, waits until every
rank has published that round, then sums the slots in rank order 0..T-1 — so every rank gets
bit-identical sums (for 2 ranks, the same bits as gloo: ``a + b`` either way). Two slot sets
alternate between rounds: a rank that saw every peer publish round n knows they all finished
reading round n - 1, so one wait per call suffices. No OS wake-up on the fast path: the wait
spins with ``sched_yield`` for its first ``SPIN_YIELDS`` checks, then sleeps 20 µs between
checks (a rank must not hold a shared core while its peer computes).

Failure: a wait that lasts ``timeout_s`` raises ``TimeoutError``, and one whose peer process
is gone (its pid, published in the segment, no longer exists) raises ``RuntimeError`` at once,
as a gloo collective fails when its peer's socket closes. The segment's name is unlinked as
soon as every rank has mapped it (a file in ``/dev/shm``, ``mmap``-ed; no
``multiprocessing.shared_memory``, whose resource tracker would unlink it twice), so nothing
is left behind even after a SIGKILL.
Tensors that are not float32 on the CPU, or larger than ``max_numel``, are not for this path
(:meth:`ShmAllReduce.fits`); the caller uses gloo for them.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

SPIN_YIELDS = 200
SHM_DIR = Path("/dev/shm")  # tmpfs on Linux
_LINE = 8  # int64s per rank header (one 64-byte cache line): round, pid


class ShmAllReduce:
    """Rank ``rank`` of ``world`` over segment ``name``; rank 0 :meth:`create`\\ s it, the others
    :meth:`attach` after that (the caller orders it, e.g. with a barrier), and rank 0
    :meth:`unlink`\\ s the name once all have attached. ``max_numel``: float32 elements per call."""

    def __init__(self, name: str, rank: int, world: int, max_numel: int, timeout_s: float,
                 create: bool) -> None:
        self.rank, self.world, self.max_numel, self.timeout_s = rank, world, max_numel, timeout_s
        head, self.path = world * _LINE * 8, SHM_DIR / name
        size = head + 2 * world * max_numel * 4
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = np.ndarray((world, _LINE), np.int64, self._map)
        self._rounds, self._pids = header[:, 0], header[:, 1]
        self._slots = np.ndarray((2, world, max_numel), np.float32, self._map, offset=head)
        if create:
            header[:] = 0
        self._pids[rank] = os.getpid()
        self.round = 0

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can take this path (float32, CPU, contiguous, ≤ ``max_numel``)."""
        return (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                and t.numel() <= self.max_numel)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (see :meth:`fits`) over every rank, in place; returns ``t``.

        Raises:
            TimeoutError: a peer did not arrive within ``timeout_s`` seconds.
            RuntimeError: a peer's process is gone.
        """
        n, flat = t.numel(), t.view(-1).numpy()
        self.round += 1
        slots = self._slots[self.round % 2]
        slots[self.rank, :n] = flat
        self._rounds[self.rank] = self.round
        if self._rounds.min() < self.round:
            self._wait()
        np.add(slots[0, :n], slots[1, :n], out=flat)
        for r in range(2, self.world):
            flat += slots[r, :n]
        return t

    def _wait(self) -> None:
        checks, deadline = 0, time.monotonic() + self.timeout_s
        while self._rounds.min() < self.round:
            checks += 1
            if checks <= SPIN_YIELDS:
                os.sched_yield()
                continue
            time.sleep(2e-5)
            if checks % 256 == 0:
                self._check_peers(deadline)

    def _check_peers(self, deadline: float) -> None:
        late = [r for r in range(self.world) if self._rounds[r] < self.round]
        for r in late:
            try:
                os.kill(int(self._pids[r]), 0)
            except ProcessLookupError:
                raise RuntimeError(f"shm all-reduce: rank {r} (pid {int(self._pids[r])}) is gone") from None
            except PermissionError:  # exists, another user's: alive
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"shm all-reduce: rank {', '.join(map(str, late))} did not "
                               f"arrive within {self.timeout_s:g} s")

    def unlink(self) -> None:
        """Rank 0: remove the segment's name (mappings stay valid; the memory goes with the
        last process that maps it)."""
        self.path.unlink(missing_ok=True)
