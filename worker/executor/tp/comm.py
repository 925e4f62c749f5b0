"""One rank's process group: the all-reduce of the forward and the step-plan broadcast.

Groups are built directly on a ``TCPStore`` (``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
not through ``torch.distributed.init_process_group``: a process then may belong to several
groups at once (tests run many rank groups from one pytest process) and no global state is
touched. Gloo on CPU; on CUDA the forward's all-reduce runs on NCCL and the plan still travels
over a gloo (CPU) group, so rank 0 never stages it on a device.

Every collective has a finite timeout (``timeout_s``). A rank waiting for the next message waits
in a timed collective too, so an idle rank 0 sends keep-alive barriers (see
:mod:`kvfleet.worker.executor.tp_executor`) more often than the timeout.

A message is a flat int64 array (:mod:`.wire`: a fixed schema, never pickle). It travels in one
fixed-size broadcast (``MESSAGE_BUFFER_BYTES``, an 8-byte length first); a message larger than
the buffer sends its remainder in a second one.

With ``GroupAddress.shm_name`` set (every rank on one host, gloo), the forward's all-reduces
go through shared memory instead (:mod:`.shm_reduce`); message broadcasts, barriers and
anything that does not fit stay on gloo.

``RankComm.times`` (:class:`CommTimes`) counts the seconds, calls and message bytes this rank
spent in :meth:`~RankComm.all_reduce` and :meth:`~RankComm.send`, always on (two
``perf_counter`` reads per call). ``bench/engine/tp_bench.py`` reads them.
"""

from __future__ import annotations

import datetime
import platform
import struct
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvfleet.worker.executor.tp.shm_reduce import ShmAllReduce

MESSAGE_BUFFER_BYTES = 8 << 10  # one broadcast holds a decode step of ~100 sequences
MAX_MESSAGE_BYTES = 256 << 20  # a longer announced length is refused, not allocated
# The shm all-reduce publishes a round after writing its slot, with plain stores: it relies on
# x86-64's store ordering (TSO); elsewhere the group stays on gloo.
_TSO_MACHINES = ("x86_64", "AMD64")
_LEN = struct.Struct("<q")


@dataclass(frozen=True)
class GroupAddress:
    """Where a group's ranks meet: rank 0's ``TCPStore`` at ``host:port``; ``backend`` is
    ``"gloo"`` or ``"nccl"``; ``timeout_s`` bounds every collective (seconds)."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 30.0
    # Same-host ranks (gloo only): the forward's float32 all-reduces of up to shm_max_numel
    # elements go through this shared-memory segment instead (see .shm_reduce); None = gloo.
    shm_name: str | None = None
    shm_max_numel: int = 1 << 20


@dataclass
class CommTimes:
    """Cumulative wall-clock seconds one rank spent inside collectives, and the calls.

    ``all_reduce_s`` includes waiting for the slowest rank to arrive (skew), not only moving
    bytes. On CUDA (NCCL) it is the time to enqueue the all-reduce, not to run it.
    """

    all_reduce_s: float = 0.0
    all_reduce_calls: int = 0
    send_s: float = 0.0
    send_calls: int = 0
    send_bytes: int = 0  # message bytes (the length prefix and buffer padding not counted)

    def snapshot(self) -> "CommTimes":
        """A copy (the counters keep running)."""
        return replace(self)

    def minus(self, earlier: "CommTimes") -> "CommTimes":
        """What was spent since ``earlier`` (a :meth:`snapshot`)."""
        return CommTimes(self.all_reduce_s - earlier.all_reduce_s,
                         self.all_reduce_calls - earlier.all_reduce_calls,
                         self.send_s - earlier.send_s, self.send_calls - earlier.send_calls,
                         self.send_bytes - earlier.send_bytes)


def host_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free port of ``host`` (``store.port`` tells which)."""
    return dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class RankComm:
    """Rank ``rank``'s membership of the group at ``addr`` (blocks until every rank joined).

    Args:
        store: rank 0 passes the store it hosts; other ranks connect to ``addr``.
        device: the rank's torch device; ``cuda`` needs ``addr.backend == "nccl"``.

    Raises:
        RuntimeError: a rank did not join within ``addr.timeout_s``.
    """

    def __init__(self, addr: GroupAddress, rank: int, store: dist.TCPStore | None = None,
                 device: torch.device | str = "cpu") -> None:
        timeout = datetime.timedelta(seconds=addr.timeout_s)
        self.rank, self.world_size, self.device = rank, addr.world_size, torch.device(device)
        self.store = store or dist.TCPStore(addr.host, addr.port, addr.world_size, False,
                                            timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        # Gloo's pairs listen on the group's own address (loopback for one host), not on
        # whatever interface the hostname resolves to.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr.host)]
        # Any: torch's stubs omit the process groups' collectives.
        self.cpu: Any = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", self.store), rank,
                                         addr.world_size, opts)
        self.dev: Any = self.cpu
        if addr.backend == "nccl":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self.store), rank,
                                             addr.world_size, nccl)
        self._buf = torch.zeros(MESSAGE_BUFFER_BYTES, dtype=torch.uint8)
        self._flag = torch.zeros(1, dtype=torch.int64)
        self.times = CommTimes()
        self.shm: ShmAllReduce | None = None
        if addr.shm_name and addr.backend == "gloo" and platform.machine() in _TSO_MACHINES:
            self._attach_shm(addr)

    def _attach_shm(self, addr: GroupAddress) -> None:
        """Rank 0 creates the segment, the others map it, rank 0 unlinks its name."""
        def make(create: bool) -> ShmAllReduce:
            assert addr.shm_name is not None
            return ShmAllReduce(addr.shm_name, self.rank, self.world_size, addr.shm_max_numel,
                                addr.timeout_s, create)

        shm = make(True) if self.rank == 0 else None
        self.barrier()
        if self.rank != 0:
            shm = make(False)
        self.barrier()
        if shm is not None and self.rank == 0:
            shm.unlink()
        self.shm = shm

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over every rank, in place; returns ``t``."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(t):
            self.shm.all_reduce(t)
        else:
            self.dev.allreduce([t]).wait()
        self.times.all_reduce_s += time.perf_counter() - start
        self.times.all_reduce_calls += 1
        return t

    def barrier(self) -> None:
        """Every rank reached this point (an all-reduce of one int on the CPU group)."""
        self.cpu.allreduce([torch.zeros(1, dtype=torch.int32)]).wait()

    def send(self, msg: np.ndarray) -> None:
        """Rank 0: broadcast ``msg`` (a 1-D int64 array, :mod:`.wire`) to every other rank."""
        start = time.perf_counter()
        data = np.ascontiguousarray(msg, dtype="<i8").tobytes()
        head = MESSAGE_BUFFER_BYTES - _LEN.size
        self._buf[: _LEN.size] = torch.frombuffer(bytearray(_LEN.pack(len(data))), dtype=torch.uint8)
        first = data[:head]
        if first:
            self._buf[_LEN.size: _LEN.size + len(first)] = torch.frombuffer(bytearray(first),
                                                                            dtype=torch.uint8)
        self.cpu.broadcast(self._buf, 0).wait()
        if len(data) > head:
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            self.cpu.broadcast(rest, 0).wait()
        self.times.send_s += time.perf_counter() - start
        self.times.send_calls += 1
        self.times.send_bytes += len(data)

    def send_flag(self, flag: bool) -> None:
        """Rank 0: broadcast one yes/no (a paused forward's per-layer decision) to every rank."""
        self._flag[0] = int(flag)
        self.cpu.broadcast(self._flag, 0).wait()

    def recv_flag(self) -> bool:
        """Ranks 1..T-1: the next :meth:`send_flag`'s yes/no."""
        self.cpu.broadcast(self._flag, 0).wait()
        return bool(self._flag[0])

    def recv(self) -> np.ndarray:
        """Ranks 1..T-1: the next message rank 0 sent, as int64 (no object is decoded).

        Raises:
            ValueError: an announced length that is negative, not whole int64s or over
                ``MAX_MESSAGE_BYTES``.
        """
        self.cpu.broadcast(self._buf, 0).wait()
        raw = self._buf.numpy().tobytes()
        (n,) = _LEN.unpack_from(raw)
        if not 0 <= n <= MAX_MESSAGE_BYTES or n % 8:
            raise ValueError(f"malformed message length {n} (whole int64s up to "
                             f"{MAX_MESSAGE_BYTES} bytes)")
        head = MESSAGE_BUFFER_BYTES - _LEN.size
        data = raw[_LEN.size: _LEN.size + min(n, head)]
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self.cpu.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return np.frombuffer(data, dtype="<i8")
