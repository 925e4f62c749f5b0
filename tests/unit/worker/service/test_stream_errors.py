"""Issue 24 item 1: whatever a call's engine request raises, the worker ends that call with a
status (a done frame on ``GenerateStream``, a non-OK status on ``Generate``), never silence."""

from __future__ import annotations

import asyncio
import types

import grpc

from kvfleet.v1 import worker_pb2
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import ZERO
from kvfleet.worker.service.server import WorkerService


class FailingLoop:
    """An engine loop whose every request fails with ``error`` (as ``Engine.add_request``
    raising a plain exception, e.g. an adapter whose load failed)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.engine = types.SimpleNamespace(scheduler=types.SimpleNamespace(config=SchedulerConfig()),
                                            step_cost=ZERO)
        self.stats = {"running": 0, "waiting": 0}

    async def generate(self, req):
        raise self.error
        yield  # an async generator, as EngineLoop.generate


def _frame(call_id: int) -> worker_pb2.GenerateStreamRequest:
    frame = worker_pb2.GenerateStreamRequest(call_id=call_id)
    frame.generate.request_id = f"r{call_id}"
    frame.generate.prompt_token_ids.extend([1, 2, 3])
    frame.generate.sampling.max_tokens = 2
    return frame


def test_a_plain_exception_ends_the_stream_call_with_internal_naming_it() -> None:
    service = WorkerService(FailingLoop(RuntimeError("adapter 'sql' failed to load: gone")),
                            "rep-x", "m", 16)
    out: asyncio.Queue = asyncio.Queue()
    asyncio.run(service._stream_call(_frame(7), out))
    frames = [out.get_nowait() for _ in range(out.qsize())]
    assert len(frames) == 1 and frames[0].call_id == 7 and frames[0].done
    assert frames[0].status_code == grpc.StatusCode.INTERNAL.value[0]
    assert "RuntimeError" in frames[0].status_message
    assert "adapter 'sql' failed to load: gone" in frames[0].status_message
    assert "rep-x" in frames[0].status_message
    assert service.reservations.count == 0  # the admission slot is returned


class _Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.status = None

    def invocation_metadata(self):
        return ()

    async def write(self, msg) -> None:
        raise AssertionError("nothing is written before the failure")

    async def abort(self, code, details):
        self.status = (code, details)
        raise _Aborted

    def set_trailing_metadata(self, md) -> None:
        pass


def test_a_plain_exception_ends_generate_with_internal_naming_it() -> None:
    service = WorkerService(FailingLoop(KeyError("slot 3")), "rep-y", "m", 16)
    ctx = FakeContext()
    try:
        asyncio.run(service.Generate(_frame(1).generate, ctx))
    except _Aborted:
        pass
    assert ctx.status is not None
    code, details = ctx.status
    assert code is grpc.StatusCode.INTERNAL and "KeyError" in details and "slot 3" in details
