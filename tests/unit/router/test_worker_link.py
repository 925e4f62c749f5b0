"""WorkerLink against a worker that accepts a call and never answers it, and one that keeps
a queued call alive with liveness frames."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvfleet.router.worker_link import WorkerCallError, WorkerLink
from kvfleet.v1 import worker_pb2, worker_pb2_grpc


class _SilentWorker(worker_pb2_grpc.WorkerServicer):
    """Answers call 1 with one message, then nothing; keeps the stream open."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    async def GenerateStream(self, request_iterator, context):
        async for frame in request_iterator:
            if frame.cancel:
                self.cancelled.append(frame.call_id)
            elif frame.call_id == 1:
                out = worker_pb2.GenerateStreamBatch()
                out.frames.add(call_id=1).message.token_ids.append(7)
                yield out


def test_a_call_with_no_frame_for_the_idle_bound_ends_with_internal() -> None:
    # Issue 24 item 1: a worker task that died without a final frame left the call open forever.
    async def scenario() -> None:
        server = grpc.aio.server()
        worker = _SilentWorker()
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = WorkerLink(channel, f"127.0.0.1:{port}")
        try:
            got = []
            for _ in (1, 2):  # call 1 after one message, call 2 before any
                call = link.call(idle_s=0.2)
                with pytest.raises(WorkerCallError) as err:
                    async with asyncio.timeout(10):  # a hang fails instead of stalling
                        async for msg in call:
                            got.append(list(msg.token_ids))
                assert err.value.code == grpc.StatusCode.INTERNAL
                assert "no frame" in err.value.details and not err.value.link_failed
            assert got == [[7]]
            for _ in range(100):  # the cancel frames reach the worker
                if worker.cancelled == [1, 2]:
                    break
                await asyncio.sleep(0.01)
            assert worker.cancelled == [1, 2]
            assert link.open_calls == 0
        finally:
            await link.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


class _QueueingWorker(worker_pb2_grpc.WorkerServicer):
    """Holds each call queued for ``waits`` liveness frames ``every_s`` apart (as long as
    the call asked for, ``keepalive_s``), then answers it."""

    def __init__(self, waits: int) -> None:
        self.waits = waits
        self.asked: list[float] = []

    async def GenerateStream(self, request_iterator, context):
        async for frame in request_iterator:
            if frame.cancel:
                continue
            self.asked.append(frame.keepalive_s)
            for _ in range(self.waits):
                await asyncio.sleep(frame.keepalive_s)
                out = worker_pb2.GenerateStreamBatch()
                out.frames.add(call_id=frame.call_id, waiting=True)
                yield out
            out = worker_pb2.GenerateStreamBatch()
            done = out.frames.add(call_id=frame.call_id, done=True)
            done.message.token_ids.append(9)
            yield out


def test_a_call_queued_on_the_worker_past_the_idle_bound_is_kept_alive() -> None:
    # A request waiting its turn sends nothing for longer than the router's idle bound: its
    # liveness frames (asked for at a third of the bound) keep it, never INTERNAL.
    async def scenario() -> None:
        server = grpc.aio.server()
        worker = _QueueingWorker(waits=4)  # 2 s queued: past the 1.5 s bound
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = WorkerLink(channel, f"127.0.0.1:{port}")
        try:
            call = link.call(idle_s=1.5)
            async with asyncio.timeout(30):
                got = [list(msg.token_ids) async for msg in call]
            assert got == [[9]]  # the liveness frames are not messages
            assert worker.asked == [pytest.approx(0.5)]
        finally:
            await link.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())
