"""``Worker.ExportBlocks`` is authorised like every worker call and bounded per caller: calls
a second and block hashes a second, past either → RESOURCE_EXHAUSTED naming the bound; an
over-long hash list → INVALID_ARGUMENT naming the field. Callers are counted apart."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from kvfleet.errors import ResourceExhausted
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import ZERO
from kvfleet.worker.service.export_limits import ExportLimits
from kvfleet.worker.service.peer_export import MAX_EXPORT_BLOCKS
from kvfleet.worker.service.server import WorkerService


class _ExportingLoop:
    """An engine loop whose exports answer at once with nothing held."""

    def __init__(self) -> None:
        self.engine = types.SimpleNamespace(
            scheduler=types.SimpleNamespace(config=SchedulerConfig()), step_cost=ZERO)
        self.stats = {"running": 0, "waiting": 0}
        self.alive = True
        self.exports = 0

    async def export_blocks(self, hashes, timeout_s):
        self.exports += 1
        return ()


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, peer: str) -> None:
        self._peer, self.status = peer, None

    def peer(self) -> str:
        return self._peer

    def time_remaining(self):
        return 1.0

    async def abort(self, code, details):
        self.status = (code, details)
        raise _Aborted()


def _call(service: WorkerService, peer: str, n: int) -> tuple | None:
    req = worker_pb2.ExportBlocksRequest(block_hashes=[i.to_bytes(16, "little") for i in range(n)])
    ctx = _Context(peer)
    try:
        asyncio.run(service.ExportBlocks(req, ctx))
    except _Aborted:
        pass
    return ctx.status


def test_export_blocks_is_bounded_per_caller_in_calls_and_hashes() -> None:
    loop = _ExportingLoop()
    service = WorkerService(loop, "rep-e", "m", 16,  # type: ignore[arg-type]
                            export_limits=ExportLimits(clock=lambda: 0.0))  # time stands still
    for _ in range(50):
        assert _call(service, "ipv4:10.0.0.7:4001", 1) is None
    code, details = _call(service, "ipv4:10.0.0.7:4002", 1)  # same host, another port
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "calls a second" in details
    assert _call(service, "ipv4:10.0.0.8:4001", 1) is None  # another caller is not held back
    assert loop.exports == 51
    for _ in range(8):  # 8 × 4,096 = a second's hashes
        assert _call(service, "ipv4:10.0.0.9:1", MAX_EXPORT_BLOCKS) is None
    code, details = _call(service, "ipv4:10.0.0.9:1", 1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "hashes a second" in details
    code, details = _call(service, "ipv4:10.0.0.10:1", MAX_EXPORT_BLOCKS + 1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes" in details


def test_the_buckets_refill_with_time_and_a_refusal_takes_nothing() -> None:
    now = [0.0]
    limits = ExportLimits(calls_per_s=2, hashes_per_s=10, clock=lambda: now[0])
    limits.take("a", 6)
    with pytest.raises(ResourceExhausted, match="hashes"):
        limits.take("a", 6)  # refused: the call it would have cost is not taken
    limits.take("a", 4)
    with pytest.raises(ResourceExhausted, match="calls"):
        limits.take("a", 0)
    now[0] = 0.5  # half a second: one call and five hashes back
    limits.take("a", 5)
    assert limits.refused == 2
    with pytest.raises(ValueError):
        ExportLimits(calls_per_s=0)


def test_export_blocks_goes_through_the_workers_authorisation() -> None:
    """Without the router's or a replica's certificate the call never reaches the handler."""
    from kvfleet.worker.replica.replica import worker_interceptors

    async def call(mutual_tls: bool):
        loop = _ExportingLoop()
        server = grpc.aio.server(interceptors=worker_interceptors(mutual_tls))
        worker_pb2_grpc.add_WorkerServicer_to_server(
            WorkerService(loop, "rep-a", "m", 16), server)  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                req = worker_pb2.ExportBlocksRequest(block_hashes=[bytes(16)])
                try:
                    await worker_pb2_grpc.WorkerStub(channel).ExportBlocks(req, timeout=10)
                    return grpc.StatusCode.OK, loop.exports
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), loop.exports
        finally:
            await server.stop(None)

    assert asyncio.run(call(True)) == (grpc.StatusCode.PERMISSION_DENIED, 0)
    assert asyncio.run(call(False)) == (grpc.StatusCode.OK, 1)  # no TLS: no identity to check
