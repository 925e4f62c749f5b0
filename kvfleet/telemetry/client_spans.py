"""The Python client's side of a trace: client-observed TTFT next to the server's numbers.

With a :class:`~kvfleet.telemetry.provider.Telemetry`, each stream is a ``client.Generate``
span (CLIENT) whose context travels to the router, so one trace holds client → router →
worker; without one, a span already current in the caller's context is propagated instead.
Either way a :class:`RequestStats` passed to ``stream(stats=…)`` is filled in.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from kvfleet.telemetry import names as n
from kvfleet.telemetry.provider import Telemetry
from kvfleet.telemetry.status import finish_reason_of_code, set_failure


@dataclass
class RequestStats:
    """One streamed request as the client saw it (seconds; None where unknown).

    ``ttft_s``/``total_s`` are client-observed; ``timing`` is the engine's own measurement
    (queue_s, prefill_s, decode_s, ttft_s); ``worker_s`` is the worker's whole handling of the
    call and ``network_s`` router ↔ worker network time (router dispatch − ``worker_s``);
    ``trace_id`` (32 hex digits) finds the trace in a backend.
    """

    ttft_s: Optional[float] = None
    total_s: Optional[float] = None
    network_s: Optional[float] = None
    worker_s: Optional[float] = None
    trace_id: str = ""
    replica_id: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    timing: dict = field(default_factory=dict)


class ClientTelemetry:
    """Instruments of one client; :meth:`start` traces one stream."""

    def __init__(self, telemetry: Optional[Telemetry] = None) -> None:
        self.telemetry = telemetry
        if telemetry is not None:
            m = telemetry.meter
            self.ttfc = m.create_histogram(
                n.GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK, unit="s",
                description="Client-observed time to the first streamed token",
                explicit_bucket_boundaries_advisory=n.TTFT_BUCKETS_S)
            self.duration = m.create_histogram(
                n.GEN_AI_CLIENT_OPERATION_DURATION, unit="s",
                description="Client-observed duration of a streamed generation",
                explicit_bucket_boundaries_advisory=n.DURATION_BUCKETS_S)

    def start(self, request, stats: Optional[RequestStats]) -> "ClientRequestTrace":
        return ClientRequestTrace(self, request, stats)


class ClientRequestTrace:
    def __init__(self, ct: ClientTelemetry, request, stats: Optional[RequestStats]) -> None:
        self.ct = ct
        self.stats = stats
        self.start = time.monotonic()
        self.first: Optional[float] = None
        self.model = request.model
        self._failure: Optional[tuple[grpc.StatusCode, str]] = None
        self._ended = False
        if ct.telemetry is not None:
            tel = ct.telemetry
            self.span = tel.tracer.start_span(
                n.CLIENT_GENERATE, kind=SpanKind.CLIENT, start_time=tel.clock.wall_ns(self.start),
                attributes={n.RPC_SYSTEM: "grpc", n.GEN_AI_PROVIDER_NAME: n.PROVIDER,
                            n.GEN_AI_REQUEST_MODEL: request.model,
                            n.GEN_AI_OPERATION_NAME: n.OPERATION_CHAT
                            if request.WhichOneof("prompt") == "messages" else n.OPERATION_TEXT})
        else:
            self.span = trace.get_current_span()  # the caller's own span, if any (not ours to end)
        if stats is not None and self.span.get_span_context().is_valid:
            stats.trace_id = trace.format_trace_id(self.span.get_span_context().trace_id)

    def metadata(self, base) -> Optional[tuple]:
        """Call metadata: ``base`` plus the trace context (None when both are empty)."""
        out = Telemetry.inject(self.span, base or ())
        return out or None

    def on_chunk(self, chunk) -> None:
        if self.first is None and chunk.token_ids:
            self.first = chunk.received_s
            if self.stats is not None:
                self.stats.ttft_s = self.first - self.start
        if chunk.finish_reason and self.stats is not None:
            s = self.stats
            s.finish_reason, s.replica_id, s.timing = chunk.finish_reason, chunk.replica_id, chunk.timing
            s.prompt_tokens, s.cached_prompt_tokens = chunk.prompt_tokens, chunk.cached_prompt_tokens
            s.completion_tokens = chunk.completion_tokens

    def on_trailers(self, trailing_metadata) -> None:
        for key, value in trailing_metadata or ():
            if self.stats is None:
                break
            if key in (n.MD_NETWORK_S, n.MD_WORKER_DURATION_S):
                try:
                    setattr(self.stats, "network_s" if key == n.MD_NETWORK_S else "worker_s",
                            float(value))
                except ValueError:
                    pass
            elif key == n.MD_TRACE_ID and not self.stats.trace_id:
                self.stats.trace_id = value

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            self._failure = (exc.code(), exc.details() or "")
        elif isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
            self._failure = (grpc.StatusCode.CANCELLED, "the caller stopped reading")
        else:
            self._failure = (grpc.StatusCode.UNKNOWN, type(exc).__name__)

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        end = time.monotonic()
        if self.stats is not None:
            self.stats.total_s = end - self.start
        tel = self.ct.telemetry
        if tel is None:
            return
        attrs = {n.GEN_AI_REQUEST_MODEL: self.model}
        if self._failure is not None:
            attrs[n.ERROR_TYPE] = self._failure[0].name
        self.ct.duration.record(end - self.start, attrs)
        if self.first is not None:
            self.ct.ttfc.record(self.first - self.start, attrs)
        if self.span.is_recording():
            if self.first is not None:
                self.span.set_attribute(n.KVFLEET_CLIENT_TTFT_S, self.first - self.start)
                self.span.add_event(n.EVENT_FIRST_TOKEN, timestamp=tel.clock.wall_ns(self.first))
            if self._failure is not None:
                code, message = self._failure
                set_failure(self.span, code, message, finish_reason_of_code(code))
            elif self.stats is not None and self.stats.finish_reason:
                self.span.set_attributes({
                    n.GEN_AI_RESPONSE_FINISH_REASONS: [self.stats.finish_reason],
                    n.GEN_AI_USAGE_INPUT_TOKENS: self.stats.prompt_tokens,
                    n.GEN_AI_USAGE_OUTPUT_TOKENS: self.stats.completion_tokens,
                    n.KVFLEET_REPLICA_ID: self.stats.replica_id})
        self.span.end(end_time=tel.clock.wall_ns(end))
