"""The Worker gRPC service: the edge of a replica (proto in, engine outputs out)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from typing import Callable, Optional

import grpc

from kvfleet import grpc_auth, priority
from kvfleet.constraint import Constraint
from kvfleet.errors import (
    FailedPrecondition,
    KvfleetError,
    StatusError,
    Unavailable,
    status_of,
)
from kvfleet.sampling_params import SamplingParams
from kvfleet.stream_limits import SlowReader, StreamLimits, write_within
from kvfleet.telemetry.names import MD_WORKER_DURATION_S
from kvfleet.telemetry.worker_spans import WorkerTelemetry
from kvfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.kv_tier.peer_pull import PeerHint, PeerPuller
from kvfleet.worker.replica.adapter_admin import AdapterAdmin
from kvfleet.worker.service.engine_loop import EngineLoop
from kvfleet.worker.service.export_limits import ExportLimits
from kvfleet.worker.service.peer_export import export_blocks, export_hashes
from kvfleet.worker.service.reservations import Reservations
from kvfleet.worker.service.wait_bound import WaitBound

log = logging.getLogger(__name__)

_FINISH = {FinishReason.STOP: common_pb2.STOP, FinishReason.LENGTH: common_pb2.LENGTH}
MIN_KEEPALIVE_S = 0.1  # the most often a call's liveness frame is sent, whatever it asks


def _forget(ended: Callable[[int], None], call_id: int, _task: asyncio.Task) -> None:
    """A call's task is done: drop it from the open calls (a done-callback)."""
    ended(call_id)


def output_to_proto(o: SeqOutput, replica_id: str) -> common_pb2.GenerateResponse:
    """Map one engine output to a stream message (finish fields on the last one only)."""
    msg = common_pb2.GenerateResponse(request_id=o.request_id, index=o.index,
                                      token_ids=o.token_ids, text=o.text)
    for lp in o.logprobs:
        msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                         top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if o.finish_reason in _FINISH:
        assert o.usage is not None and o.timing is not None  # set on every last output
        msg.finish_reason = _FINISH[o.finish_reason]
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=o.usage.prompt_tokens, cached_prompt_tokens=o.usage.cached_prompt_tokens,
            completion_tokens=o.usage.completion_tokens))
        msg.timing.CopyFrom(common_pb2.Timing(
            queue_s=o.timing.queue_s, prefill_s=o.timing.prefill_s,
            decode_s=o.timing.decode_s, ttft_s=o.timing.ttft_s, replica_s=o.timing.replica_s))
        msg.replica_id = replica_id
    return msg


_ABNORMAL = {
    FinishReason.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded on the worker"),
    FinishReason.CANCELLED: (grpc.StatusCode.CANCELLED, "request aborted"),
}


def _done(call_id: int, code: grpc.StatusCode, details: str) -> worker_pb2.GenerateStreamResponse:
    return worker_pb2.GenerateStreamResponse(call_id=call_id, done=True,
                                             status_code=code.value[0], status_message=details)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Serves one replica's engine over gRPC; admission is counted on arrival
    (:class:`Reservations`, limit ``SchedulerConfig.max_sequences``). A write that waits
    more than ``limits.stall_s`` for its reader cancels the stream (``Generate``: that call;
    ``GenerateStream``: the whole stream, every call on it)."""

    def __init__(self, loop: EngineLoop, replica_id: str, model: str, block_size: int,
                 epoch_fn=lambda: 0, telemetry: Optional[WorkerTelemetry] = None,
                 ranks_fn=lambda: [], drain_fn=None,
                 limits: StreamLimits = StreamLimits(),
                 adapter_admin: Optional[AdapterAdmin] = None,
                 puller: Optional[PeerPuller] = None,
                 max_queue_wait_s: float = float("inf"),
                 export_limits: Optional[ExportLimits] = None) -> None:
        self.loop = loop
        # Each caller's bounds on ExportBlocks (calls and hashes a second).
        self.export_limits = export_limits or ExportLimits()
        self.puller = puller  # pulls a hinted prefix from a peer (None: never)
        self.limits = limits
        self.adapter_admin = adapter_admin  # None: this replica serves no adapters
        self.ranks_fn = ranks_fn  # -> [RankInfo], rank 0 first
        self.replica_id = replica_id
        self.model = model
        self.block_size = block_size
        self.epoch_fn = epoch_fn
        self.draining = False
        self.drain_fn = drain_fn  # async (timeout_s | None) -> sequences the timeout ended
        sched = loop.engine.scheduler.config
        self.reservations = Reservations(sched.max_sequences, sched.tenant_share)
        # ... and in seconds of queued work (refused past it at once, never queued).
        self.wait_bound = WaitBound(max_queue_wait_s, sched.max_num_seqs,
                                    sched.max_num_batched_tokens, loop.engine.step_cost)
        # Spans and metrics; the engine loop's on_finish hook must call telemetry.on_finished.
        self.telemetry = telemetry or WorkerTelemetry(replica_id=replica_id, model=model)

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context):
        _ensure_id(request)
        with self.telemetry.start(request, context.invocation_metadata()) as trace:
            try:
                async with contextlib.aclosing(self._serve(request, trace)) as messages:
                    async for msg in messages:
                        await write_within(context.write(msg), self.limits,
                                           f"request {request.request_id}")
            except KvfleetError as exc:
                await context.abort(*status_of(exc))
            except Exception as exc:  # never a stream without a status: INTERNAL naming it
                log.exception("request %s failed on replica %s", request.request_id, self.replica_id)
                await context.abort(grpc.StatusCode.INTERNAL, self._internal(exc))
            # The router subtracts this from its dispatch time: network time.
            context.set_trailing_metadata(((MD_WORKER_DURATION_S, f"{trace.handler_done():.6f}"),))

    async def GenerateStream(self, frames, context: grpc.aio.ServicerContext):
        """Calls multiplexed on one stream (see worker.proto); each runs as its own task and
        their frames are written by this handler alone (gRPC allows one write at a time)."""
        out: asyncio.Queue = asyncio.Queue()  # frames to write; None = re-check for the end
        calls: dict[int, asyncio.Task] = {}
        reading = True

        def ended(call_id: int) -> None:
            calls.pop(call_id, None)
            out.put_nowait(None)

        async def read() -> None:
            nonlocal reading
            try:
                async for frame in frames:
                    action = frame.WhichOneof("action")
                    if action == "cancel":
                        task = calls.get(frame.call_id)
                        if task is not None:
                            task.cancel()
                    elif action is None:
                        out.put_nowait(_done(frame.call_id, grpc.StatusCode.INVALID_ARGUMENT,
                                             "action: one of generate or cancel is required"))
                    elif frame.call_id in calls:
                        out.put_nowait(_done(frame.call_id, grpc.StatusCode.INVALID_ARGUMENT,
                                             f"call_id {frame.call_id} is already open"))
                    else:
                        task = asyncio.create_task(self._stream_call(frame, out))
                        calls[frame.call_id] = task
                        task.add_done_callback(functools.partial(_forget, ended, frame.call_id))
            finally:
                reading = False  # the caller half-closed: open calls finish, then the stream ends
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                batch = worker_pb2.GenerateStreamBatch()
                frame = await out.get()
                while True:  # every frame ready now (often one engine step's) in one message
                    if frame is not None:
                        batch.frames.append(frame)
                    if out.empty():
                        break
                    frame = out.get_nowait()
                if batch.frames:
                    await write_within(context.write(batch), self.limits, "GenerateStream")
                elif not reading and not calls:
                    break
        finally:
            reader.cancel()
            for task in list(calls.values()):
                task.cancel()  # the stream is gone: abort its calls (frees their blocks)

    async def _stream_call(self, frame: worker_pb2.GenerateStreamRequest, out: asyncio.Queue) -> None:
        """One call of a GenerateStream: its messages, then a done frame, into ``out``; and,
        when the call asks (``keepalive_s``), a liveness frame whenever it has been silent
        that long while this replica holds it (queued behind other work)."""
        request = frame.generate
        _ensure_id(request)
        sent = [time.monotonic()]  # when the call last put a frame (a list: shared with the task)
        alive = None
        if frame.keepalive_s > 0:
            alive = asyncio.create_task(self._keep_alive(frame.call_id, request.request_id,
                                                         frame.keepalive_s, out, sent))
        try:
            await self._stream_frames(frame, _Stamped(out, sent))
        finally:
            if alive is not None:
                alive.cancel()

    async def _keep_alive(self, call_id: int, request_id: str, every_s: float,
                          out: asyncio.Queue, sent: list[float]) -> None:
        """Put a ``waiting`` frame for the call each ``every_s`` (at least
        :data:`MIN_KEEPALIVE_S`) it sent nothing, while the replica holds the request."""
        every_s = max(MIN_KEEPALIVE_S, every_s)
        while True:
            now = time.monotonic()
            if now < sent[0] + every_s:
                await asyncio.sleep(sent[0] + every_s - now)
                continue
            if request_id in self.reservations:  # admitted, not finished: it waits its turn
                out.put_nowait(worker_pb2.GenerateStreamResponse(call_id=call_id, waiting=True))
            sent[0] = now

    async def _stream_frames(self, frame: worker_pb2.GenerateStreamRequest, out) -> None:
        request, call_id = frame.generate, frame.call_id
        finals_left = request.sampling.n if request.sampling.n > 0 else 1
        with self.telemetry.start(request, tuple(frame.trace_context.items())) as trace:
            last = None  # the call's last message rides on its done frame (one frame fewer)
            try:
                async with contextlib.aclosing(self._serve(request, trace)) as messages:
                    async for msg in messages:
                        finals_left -= bool(msg.finish_reason)
                        if finals_left <= 0 and last is None:
                            last = msg  # nothing follows the last sample's final message
                        else:
                            out.put_nowait(worker_pb2.GenerateStreamResponse(call_id=call_id,
                                                                             message=msg))
            except Exception as exc:  # every failure ends the call with a status
                if not isinstance(exc, KvfleetError):
                    log.exception("call %s (request %s) failed on replica %s", call_id,
                                  request.request_id, self.replica_id)
                status = (status_of(exc) if isinstance(exc, KvfleetError)
                          else (grpc.StatusCode.INTERNAL, self._internal(exc)))
                if last is not None:
                    out.put_nowait(worker_pb2.GenerateStreamResponse(call_id=call_id, message=last))
                out.put_nowait(_done(call_id, *status))
                return
            done = _done(call_id, grpc.StatusCode.OK, "")
            done.worker_duration_s = trace.handler_done()
            if last is not None:
                done.message.CopyFrom(last)
            out.put_nowait(done)

    def _internal(self, exc: BaseException) -> str:
        """INTERNAL's message for an unexpected failure: the replica, the type and its text."""
        return f"internal error on replica {self.replica_id}: {type(exc).__name__}: {exc}"

    async def _serve(self, request: worker_pb2.WorkerGenerateRequest, trace):
        """One Generate call's messages, for both transports.

        Raises:
            KvfleetError: refused before reaching the engine, or (:class:`StatusError`) ended
                abnormally (deadline, abort, engine error); ``status_of`` gives the status.
        """
        try:
            if self.draining:
                raise Unavailable(f"replica {self.replica_id} is draining")
            engine_request = _engine_request(request)
            hint = PeerHint.from_proto(request.peer) if request.HasField("peer") else None
            # Refuse here, before the engine inbox (whose counts are a step stale), and before
            # any compile: a request the replica turns away costs no compile thread.
            self.reservations.take(request.request_id, engine_request.params.n,
                                   engine_request.tenant)
            try:
                params = engine_request.params
                self.wait_bound.take(request.request_id, len(engine_request.prompt_token_ids),
                                     params.max_tokens, params.n)
                if engine_request.constraint is not None:
                    # Off the engine thread, within the tenant's share of the compile threads.
                    grammar = await self.loop.engine.grammars.compile_async(
                        engine_request.constraint, engine_request.tenant)
                    engine_request = dataclasses.replace(engine_request, grammar=grammar)
                if self.puller is not None and hint is not None:  # lands in the host tier
                    engine_request = await self.puller.prepare(engine_request, hint)
                stream = self.loop.generate(engine_request)
                try:
                    async for out in stream:
                        if out.finish_reason in _ABNORMAL or out.finish_reason is FinishReason.ERROR:
                            # A failure after tokens were sent ends the stream with a non-OK status.
                            raise StatusError(*(_ABNORMAL.get(out.finish_reason)
                                               or status_of(out.error or RuntimeError())))
                        self.wait_bound.started(request.request_id)
                        yield output_to_proto(out, self.replica_id)
                finally:
                    await stream.aclose()  # caller gone at a bare yield: abort the request now
            finally:
                self.wait_bound.release(request.request_id)
                self.reservations.release(request.request_id)
        except KvfleetError as exc:
            if not isinstance(exc, (StatusError, SlowReader)):  # an abnormal end is no refusal
                trace.refused(*status_of(exc))
            raise

    async def Abort(self, request, context):
        found = self.loop.engine.is_active(request.request_id)
        self.loop.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def ExportBlocks(self, request, context):
        """A peer's pull (see ``peer_export``): these blocks, into the node's host tier;
        within the caller's bounds (:class:`ExportLimits`: RESOURCE_EXHAUSTED past them)."""
        try:
            if self.draining:
                raise Unavailable(f"replica {self.replica_id} is draining")
            hashes = export_hashes(request)  # a malformed request is refused first
            self.export_limits.take(_caller(context), len(hashes))
            ranks = self.ranks_fn()
            return await export_blocks(self.loop, request, ranks[0].node_id if ranks else "",
                                       context.time_remaining())
        except KvfleetError as exc:
            await context.abort(*status_of(exc))

    async def LoadAdapter(self, request, context):
        return await self._adapter_call(context, lambda a: a.load(request.name, request.path))

    async def UnloadAdapter(self, request, context):
        async def unload(admin):
            await admin.unload(request.name)
            return ""
        return await self._adapter_call(context, unload)

    async def _adapter_call(self, context, op):
        try:
            if self.adapter_admin is None:
                raise FailedPrecondition("this replica serves no adapters (max_loras = 0)")
            revision = await op(self.adapter_admin)
        except KvfleetError as exc:
            await context.abort(*status_of(exc))
        return common_pb2.AdapterReply(results=[
            common_pb2.ReplicaAdapterResult(replica_id=self.replica_id, revision=revision)])

    async def Stats(self, request, context):
        s = self.loop.stats
        return worker_pb2.StatsResponse(
            replica_id=self.replica_id, running=s["running"], waiting=s["waiting"],
            num_free_blocks=s["num_free_blocks"], num_total_blocks=s["num_total_blocks"],
            block_size=self.block_size, epoch=self.epoch_fn(), model=self.model,
            tensor_parallel_size=max(1, len(ranks := self.ranks_fn())),
            ranks=[common_pb2.RankStatus(**dataclasses.asdict(r)) for r in ranks])

    async def Drain(self, request, context):
        """Drain this replica (see ``ReplicaServer.drain``); answers when it is done."""
        if request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"timeout_s must be >= 0, got {request.timeout_s}")
        running = self.reservations.count
        self.draining = True
        ended = 0
        if self.drain_fn is not None:
            ended = await self.drain_fn(request.timeout_s or None)
        return worker_pb2.DrainResponse(running=running, ended_by_timeout=ended)


class _Stamped:
    """``out`` (a queue of frames) that records when a frame was last put in ``sent[0]``."""

    def __init__(self, out: asyncio.Queue, sent: list[float]) -> None:
        self._out, self._sent = out, sent

    def put_nowait(self, frame) -> None:
        self._sent[0] = time.monotonic()
        self._out.put_nowait(frame)


def _caller(context) -> str:
    """Who a call counts against: its authorised identity (every replica presents the same
    one) at its network host (``ipv4:10.0.0.7:4001`` → ``10.0.0.7``: any port)."""
    try:
        identity = grpc_auth.caller()
    except LookupError:  # served without the interceptor (in-process tests)
        identity = ""
    peer = context.peer() or ""
    host = peer.split(":", 1)[-1].rsplit(":", 1)[0] if ":" in peer else peer
    return f"{identity}@{host}"


def _ensure_id(request: worker_pb2.WorkerGenerateRequest) -> None:
    if not request.request_id:
        request.request_id = uuid.uuid4().hex  # one id for the engine and the trace


def _engine_request(request: worker_pb2.WorkerGenerateRequest) -> EngineRequest:
    params = SamplingParams.from_proto(request.sampling)
    deadline = None
    if request.deadline_unix_s > 0:
        deadline = time.monotonic() + (request.deadline_unix_s - time.time())
    return EngineRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(request.prompt_token_ids), params=params,
        tenant=request.tenant or request.cache_scope or "default",
        cache_scope=request.cache_scope or request.tenant or "default",
        cache_salt=request.cache_salt,
        adapter=request.adapter, deadline=deadline, constraint=Constraint.from_proto(request),
        # The router resolved it; checked again here (fail closed: INVALID_ARGUMENT if out of range).
        priority=(priority.parse(request.priority) if request.HasField("priority")
                  else priority.DEFAULT))
