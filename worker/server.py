"""The Worker gRPC service: the edge of a replica (proto in, engine outputs out)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Optional

import grpc

from kvfleet.errors import KvfleetError, NotFound, Unavailable, status_of
from kvfleet.sampling_params import SamplingParams
from kvfleet.telemetry.names import MD_WORKER_DURATION_S
from kvfleet.telemetry.worker_spans import WorkerTelemetry
from kvfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine import EngineRequest
from kvfleet.worker.engine_loop import EngineLoop
from kvfleet.worker.outputs import SeqOutput
from kvfleet.worker.request import FinishReason

log = logging.getLogger(__name__)

_FINISH = {FinishReason.STOP: common_pb2.STOP, FinishReason.LENGTH: common_pb2.LENGTH}


def output_to_proto(o: SeqOutput, replica_id: str) -> common_pb2.GenerateResponse:
    """Map one engine output to a stream message (finish fields on the last one only)."""
    msg = common_pb2.GenerateResponse(request_id=o.request_id, index=o.index,
                                      token_ids=o.token_ids, text=o.text)
    for lp in o.logprobs:
        msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                         top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if o.finish_reason in _FINISH:
        msg.finish_reason = _FINISH[o.finish_reason]
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=o.usage.prompt_tokens, cached_prompt_tokens=o.usage.cached_prompt_tokens,
            completion_tokens=o.usage.completion_tokens))
        msg.timing.CopyFrom(common_pb2.Timing(
            queue_s=o.timing.queue_s, prefill_s=o.timing.prefill_s,
            decode_s=o.timing.decode_s, ttft_s=o.timing.ttft_s))
        msg.replica_id = replica_id
    return msg


_ABNORMAL = {
    FinishReason.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded on the worker"),
    FinishReason.CANCELLED: (grpc.StatusCode.CANCELLED, "request aborted"),
}


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Serves one replica's engine over gRPC."""

    def __init__(self, loop: EngineLoop, replica_id: str, model: str, block_size: int,
                 epoch_fn=lambda: 0, telemetry: Optional[WorkerTelemetry] = None) -> None:
        self.loop = loop
        self.replica_id = replica_id
        self.model = model
        self.block_size = block_size
        self.epoch_fn = epoch_fn
        self.draining = False
        # Spans and metrics; the engine loop's on_finish hook must call telemetry.on_finished.
        self.telemetry = telemetry or WorkerTelemetry(replica_id=replica_id, model=model)

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context):
        if not request.request_id:
            request.request_id = uuid.uuid4().hex  # one id for the engine and the trace
        with self.telemetry.start(request, context.invocation_metadata()) as trace:
            try:
                if self.draining:
                    raise Unavailable(f"replica {self.replica_id} is draining")
                stream = self.loop.generate(_engine_request(request))
                try:
                    async for out in stream:
                        if out.finish_reason in _ABNORMAL or out.finish_reason is FinishReason.ERROR:
                            # A failure after tokens were sent ends the stream with a non-OK status.
                            code, msg = _ABNORMAL.get(out.finish_reason) or status_of(
                                out.error or RuntimeError())
                            await context.abort(code, msg)
                        yield output_to_proto(out, self.replica_id)
                    # The router subtracts this from its dispatch time: network time.
                    context.set_trailing_metadata(
                        ((MD_WORKER_DURATION_S, f"{trace.handler_done():.6f}"),))
                finally:
                    await stream.aclose()  # client gone at a bare yield: abort the request now
            except KvfleetError as exc:
                trace.refused(*status_of(exc))
                await context.abort(*status_of(exc))

    async def Abort(self, request, context):
        found = self.loop.engine.is_active(request.request_id)
        self.loop.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def Stats(self, request, context):
        s = self.loop.stats
        return worker_pb2.StatsResponse(
            replica_id=self.replica_id, running=s["running"], waiting=s["waiting"],
            num_free_blocks=s["num_free_blocks"], num_total_blocks=s["num_total_blocks"],
            block_size=self.block_size, epoch=self.epoch_fn(), model=self.model)

    async def Drain(self, request, context):
        self.draining = True
        return worker_pb2.DrainResponse(running=self.loop.stats["running"])


def _engine_request(request: worker_pb2.WorkerGenerateRequest) -> EngineRequest:
    if request.adapter:
        raise NotFound(f"adapter {request.adapter!r} is not loaded on this replica")
    params = SamplingParams.from_proto(request.sampling)
    deadline = None
    if request.deadline_unix_s > 0:
        deadline = time.monotonic() + (request.deadline_unix_s - time.time())
    return EngineRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(request.prompt_token_ids), params=params,
        tenant=request.tenant or "default", cache_salt=request.cache_salt,
        adapter=request.adapter, deadline=deadline)
