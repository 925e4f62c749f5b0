"""The router's path to one replica: every routed call multiplexed on one ``Worker.GenerateStream``.

A new gRPC call per request costs the router (and the worker) a new HTTP/2 stream, metadata
and a status on top of the messages; on one long-lived stream a routed call is one frame each
way, and the frames of one engine step arrive as one batch message (``python -m bench
router_cost`` measures the difference: docs/benchmarks.md, Routing).

One :class:`WorkerLink` per replica channel. The stream opens on first use and again after it
ends; when it ends (worker gone, channel closed) every call still open on it fails with
UNAVAILABLE (``link_failed``), and the worker aborts them (their KV blocks are freed).

A call that gets no frame for ``idle_s`` seconds while the stream stays up (a worker task that
died without its final frame) is cancelled on the worker and fails INTERNAL, so no client
waits forever on it. A call waiting its turn in the replica's queue is alive: the call asks
the worker for a liveness frame (``waiting``) every :data:`KEEPALIVES_PER_IDLE`-th of
``idle_s`` it spends silent while the replica still holds it.

The reader never waits for a call's consumer: a call whose consumer (the client's stream at
the router's edge) leaves more than ``max_unread`` frames untaken is cancelled on the worker
and raises :class:`~kvfleet.stream_limits.SlowReader`; the other calls go on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator, Optional, Sequence

import grpc

from kvfleet.errors import StatusError
from kvfleet.stream_limits import DEFAULT_MAX_UNREAD, Outbox
from kvfleet.telemetry.names import MD_WORKER_DURATION_S
from kvfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Seconds a routed call may go without a frame from its worker: above any queue wait plus
# prefill the worker's own bounds allow (its waiting queue, the request's deadline).
DEFAULT_CALL_IDLE_S = 120.0
KEEPALIVES_PER_IDLE = 3  # liveness frames asked for per idle bound (two may be late or lost)


class WorkerCallError(StatusError):
    """A routed call ended with a non-OK status (``code``: :class:`grpc.StatusCode`).

    ``link_failed``: the stream to the replica failed (replica gone or unreachable), as
    opposed to the replica ending this call with a status of its own.
    """

    def __init__(self, code: grpc.StatusCode, details: str, link_failed: bool = False) -> None:
        super().__init__(code, details)
        self.link_failed = link_failed


def _rpc_error_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _Stream:
    """One open GenerateStream: its call, reader task and the queues of its open calls."""

    def __init__(self, call) -> None:
        self.call = call
        self.queues: dict[int, Outbox] = {}
        self.write_lock = asyncio.Lock()  # gRPC allows one outstanding write per call
        self.ended: Optional[WorkerCallError] = None
        self.reader: Optional[asyncio.Task] = None


class WorkerLink:
    """Routed calls to one replica over one multiplexed stream; see the module docstring."""

    def __init__(self, channel: grpc.aio.Channel, address: str = "") -> None:
        self.address = address
        self._stub = worker_pb2_grpc.WorkerStub(channel)
        self._stream: Optional[_Stream] = None
        self._ids = itertools.count(1)

    @property
    def open_calls(self) -> int:
        """Calls open on the stream now."""
        stream = self._stream
        return 0 if stream is None or stream.ended is not None else len(stream.queues)

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        """The channel's stub, for the worker's unary RPCs (LoRA load/unload)."""
        return self._stub

    def call(self, trace_context: Sequence[tuple[str, str]] = (),
             max_unread: int = DEFAULT_MAX_UNREAD, idle_s: float = DEFAULT_CALL_IDLE_S
             ) -> "LinkCall":
        """A new call: fill ``call.request`` (a ``WorkerGenerateRequest``), then iterate it for
        the worker's messages (``async for msg in call``); it is sent on the first iteration.
        ``max_unread``: frames it may buffer for a consumer that does not take them;
        ``idle_s``: seconds it may wait for a frame before it fails INTERNAL."""
        return LinkCall(self, trace_context, max_unread, idle_s)

    def _open(self) -> _Stream:
        if self._stream is None or self._stream.ended is not None:
            stream = _Stream(self._stub.GenerateStream())
            stream.reader = asyncio.create_task(self._read(stream))
            self._stream = stream
        return self._stream

    async def _read(self, stream: _Stream) -> None:
        err = WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} closed the stream",
                              link_failed=True)
        try:
            while True:
                batch = await stream.call.read()
                if batch is grpc.aio.EOF:
                    break
                for frame in batch.frames:
                    queue = stream.queues.get(frame.call_id)
                    if queue is not None:
                        queue.put(frame)
        except grpc.aio.AioRpcError as exc:  # the replica, not the call, failed: retryable
            err = WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"stream to worker {self.address} "
                                  f"ended: {_rpc_error_text(exc)}", link_failed=True)
        except asyncio.CancelledError:
            err = WorkerCallError(grpc.StatusCode.UNAVAILABLE,
                                  f"the router closed its stream to worker {self.address}",
                                  link_failed=True)
            raise
        finally:
            stream.ended = err
            for queue in list(stream.queues.values()):
                queue.put(err)
            stream.queues.clear()
            stream.call.cancel()  # no-op when it already ended

    async def _send(self, stream: _Stream, frame: worker_pb2.GenerateStreamRequest) -> None:
        async with stream.write_lock:
            if stream.ended is not None:
                raise WorkerCallError(stream.ended.code, stream.ended.details, link_failed=True)
            try:
                await stream.call.write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                raise WorkerCallError(grpc.StatusCode.UNAVAILABLE, f"cannot send to worker "
                                      f"{self.address}: {_rpc_error_text(exc)}",
                                      link_failed=True) from exc

    async def close(self) -> None:
        """End the stream (the worker aborts every call still open on it)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.call.cancel()
            if stream.reader is not None:
                stream.reader.cancel()
                await asyncio.gather(stream.reader, return_exceptions=True)


class LinkCall:
    """One routed call: iterate for the worker's messages; :meth:`trailing_metadata` after.

    Raises :class:`WorkerCallError` from the iteration when the call ends with a non-OK status,
    :class:`~kvfleet.stream_limits.SlowReader` when its consumer fell ``max_unread`` frames
    behind (the call is cancelled on the worker then).
    """

    def __init__(self, link: WorkerLink, trace_context, max_unread: int = DEFAULT_MAX_UNREAD,
                 idle_s: float = DEFAULT_CALL_IDLE_S) -> None:
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self._link = link
        self._idle_s = idle_s
        self._frame = worker_pb2.GenerateStreamRequest(call_id=next(link._ids),
                                                       keepalive_s=idle_s / KEEPALIVES_PER_IDLE)
        self.request: worker_pb2.WorkerGenerateRequest = self._frame.generate
        for key, value in trace_context:
            self._frame.trace_context[key] = value
        self._stream: Optional[_Stream] = None
        self._queue: Outbox = Outbox(max_unread, self.cancel,
                                     f"call to worker {link.address or '?'}")
        self._sent = False  # the generate frame went (or may have gone) to the worker
        self._done = False
        self._worker_duration_s: Optional[float] = None

    async def __aiter__(self) -> AsyncIterator[common_pb2.GenerateResponse]:
        stream = self._stream = self._link._open()
        call_id = self._frame.call_id
        stream.queues[call_id] = self._queue
        try:
            self._sent = True
            await self._link._send(stream, self._frame)
            while True:
                frame = await self._next_frame()
                if isinstance(frame, WorkerCallError):  # the stream ended: shared by its calls
                    self._done = True
                    raise WorkerCallError(frame.code, frame.details, link_failed=True)
                if frame.waiting:  # queued on the replica, alive: the idle bound starts again
                    continue
                if frame.HasField("message"):
                    yield frame.message
                if frame.done:
                    self._done = True
                    if frame.status_code:
                        raise WorkerCallError(_CODES.get(frame.status_code, grpc.StatusCode.UNKNOWN),
                                              frame.status_message)
                    self._worker_duration_s = frame.worker_duration_s
                    return
        finally:
            stream.queues.pop(call_id, None)
            self.cancel()  # the caller left early: abort it on the worker

    async def _next_frame(self):
        if not self._queue.empty():  # the common case: no timer armed
            return await self._queue.get()
        try:
            async with asyncio.timeout(self._idle_s):
                return await self._queue.get()
        except TimeoutError:
            raise WorkerCallError(grpc.StatusCode.INTERNAL, f"worker {self._link.address or '?'} "
                                  f"sent no frame for this call in {self._idle_s:g} s") from None

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """What ``Worker.Generate`` would send as trailers: the worker's handler time."""
        if self._worker_duration_s is None:
            return ()
        return ((MD_WORKER_DURATION_S, f"{self._worker_duration_s:.6f}"),)

    def cancel(self) -> None:
        """Abort the call on the worker if it is still open (no-op once it ended)."""
        if self._done:
            return
        self._done = True
        stream = self._stream
        if stream is None or not self._sent:
            return
        stream.queues.pop(self._frame.call_id, None)
        if stream.ended is None:
            frame = worker_pb2.GenerateStreamRequest(call_id=self._frame.call_id, cancel=True)
            task = asyncio.get_running_loop().create_task(self._link._send(stream, frame))
            task.add_done_callback(_ignore_result)


def _ignore_result(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("cancel frame not sent: %s", task.exception())
