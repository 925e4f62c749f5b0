"""The router's spans and metrics for one ``Router.Generate`` call.

    router.Generate (SERVER, parent: the client's context from gRPC metadata)
      ├─ router.tokenize
      ├─ router.route      (policy, matched blocks, chosen replica, Redis time)
      └─ router.dispatch   (CLIENT; its context travels to the worker in gRPC metadata)

Network time = ``router.dispatch`` duration − the worker's ``worker.Generate`` duration (sent
back in the ``kvfleet-worker-duration-s`` trailer): an attribute on ``router.dispatch``, a
histogram, and a trailer to the client. Every duration is this process's monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterable, Iterator, Optional

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from kvfleet import priority
from kvfleet.telemetry import names as n
from kvfleet.telemetry.provider import Telemetry
from kvfleet.telemetry.status import finish_reason_of_code, set_failure
from kvfleet.v1 import common_pb2

_FINISH = {common_pb2.STOP: n.FINISH_STOP, common_pb2.LENGTH: n.FINISH_LENGTH}


class RouterTelemetry:
    """Instruments of one router process; :meth:`request` traces one call."""

    def __init__(self, telemetry: Optional[Telemetry] = None) -> None:
        self.telemetry = telemetry or Telemetry.disabled("router")
        meter = self.telemetry.meter
        self.request_duration = meter.create_histogram(
            n.GEN_AI_SERVER_REQUEST_DURATION, unit="s",
            description="Router.Generate duration, from the call's arrival to its end",
            explicit_bucket_boundaries_advisory=n.DURATION_BUCKETS_S)
        self.network_duration = meter.create_histogram(
            n.METRIC_NETWORK_DURATION, unit="s",
            description="router.dispatch minus worker.Generate: network and (de)serialisation",
            explicit_bucket_boundaries_advisory=n.NETWORK_BUCKETS_S)
        self.route_duration = meter.create_histogram(
            n.METRIC_ROUTE_DURATION, unit="s",
            description="Choosing a replica, including the prefix-index round trip",
            explicit_bucket_boundaries_advisory=n.NETWORK_BUCKETS_S)

    def request(self, metadata: Optional[Iterable[tuple[str, str]]],
                prompt_kind: Optional[str]) -> "RouterRequestTrace":
        """Trace one ``Router.Generate`` call (span ``router.Generate``)."""
        return RouterRequestTrace(self, metadata, prompt_kind)

    def http_request(self, headers: Iterable[tuple[str, str]], route: str, chat: bool,
                     user: str = "") -> "RouterRequestTrace":
        """Trace one HTTP ``POST route`` (span ``POST <route>``, HTTP semantic conventions; its
        children are the gRPC call's). ``headers``: lower-case names (W3C trace context)."""
        attrs = {n.HTTP_REQUEST_METHOD: "POST", n.HTTP_ROUTE: route}
        if user:
            attrs[n.USER_ID] = user
        return RouterRequestTrace(self, headers, "messages" if chat else "text",
                                  name=f"POST {route}", attributes=attrs)


class RouterRequestTrace:
    """Use as a context manager around the whole handler; its exit ends every open span.

    An exit by ``CancelledError``/``GeneratorExit`` (client gone) ends the spans with ERROR
    status and ``finish_reason=cancelled``; by ``AbortError`` with what :meth:`fail` recorded.
    """

    def __init__(self, rt: RouterTelemetry, metadata, prompt_kind: Optional[str],
                 name: str = n.ROUTER_GENERATE, attributes: Optional[dict] = None) -> None:
        self.rt = rt
        self.tel = rt.telemetry
        self.clock = self.tel.clock
        self.start = self.clock.now()
        self.model, self.adapter = "", ""
        self.operation = n.OPERATION_CHAT if prompt_kind == "messages" else n.OPERATION_TEXT
        self._failure: Optional[tuple[grpc.StatusCode, str]] = None
        self._finish_reasons: list[str] = []
        self._dispatch = None
        self._dispatch_start = 0.0
        self.network_s: Optional[float] = None
        self.worker_s: Optional[float] = None
        self.prompt_tokens = 0  # the router's count, once tokenized (recorded or not)
        self.span = self.tel.tracer.start_span(
            name, context=self.tel.extract(metadata), kind=SpanKind.SERVER,
            start_time=self.clock.wall_ns(self.start))
        self.recording = self.span.is_recording()
        if self.recording:
            # Few attributes on purpose: encoding them dominates what tracing costs per request.
            self.span.set_attributes(attributes or {n.RPC_SYSTEM: "grpc"})
            self.span.set_attributes({n.GEN_AI_OPERATION_NAME: self.operation,
                                      n.GEN_AI_PROVIDER_NAME: n.PROVIDER})

    # ---- phases -----------------------------------------------------------------------------
    def on_request(self, model: str, params, tenant: str, adapter: str = "",
                   level: Optional[int] = None) -> None:
        """The validated request: model, sampling, tenant, LoRA adapter (one the replicas
        serve: the router checked it, so it may label metrics) and priority number."""
        self.model, self.adapter = model, adapter
        if self.recording:
            attrs = {n.GEN_AI_REQUEST_MODEL: model, n.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
                     n.GEN_AI_REQUEST_TEMPERATURE: params.temperature, n.KVFLEET_TENANT: tenant}
            if level is not None:
                attrs[n.KVFLEET_PRIORITY] = level
                attrs[n.KVFLEET_PRIORITY_CLASS] = priority.label(level)
            if adapter:
                attrs[n.KVFLEET_ADAPTER] = adapter
            if params.top_p != 1.0:  # sampling controls only when they differ from the default
                attrs[n.GEN_AI_REQUEST_TOP_P] = params.top_p
            if params.top_k:
                attrs[n.GEN_AI_REQUEST_TOP_K] = params.top_k
            if params.n != 1:
                attrs[n.GEN_AI_REQUEST_CHOICE_COUNT] = params.n
            self.span.set_attributes(attrs)

    @contextlib.contextmanager
    def tokenize(self) -> Iterator[dict]:
        """Span ``router.tokenize``; the block yields a dict where it puts ``tokens``."""
        start = self.clock.now()
        out: dict = {}
        try:
            yield out
        finally:
            self.prompt_tokens = out.get("tokens", 0)
            if self.recording:
                self._child(n.ROUTER_TOKENIZE, start, self.clock.now(),
                            {n.GEN_AI_USAGE_INPUT_TOKENS: out.get("tokens", 0)})

    def routed(self, start: float, decision, policy: str) -> None:
        """Span ``router.route`` (hashing, index lookup, policy) from ``start`` to now."""
        end = self.clock.now()
        self.rt.route_duration.record(end - start, {n.KVFLEET_ROUTE_POLICY: policy})
        if self.recording:
            info = decision.candidate.info
            self._child(n.ROUTER_ROUTE, start, end, {
                n.KVFLEET_ROUTE_POLICY: policy, n.KVFLEET_REPLICA_ID: info.replica_id,
                n.KVFLEET_ROUTE_PROMPT_BLOCKS: decision.num_blocks,
                n.KVFLEET_ROUTE_MATCHED_BLOCKS: decision.candidate.matched_blocks,
                n.KVFLEET_ROUTE_HOST_BLOCKS: decision.candidate.host_blocks,
                n.KVFLEET_ROUTE_REDIS_S: decision.redis_s,
                n.KVFLEET_ROUTE_INDEX_USED: decision.index_used,
                n.KVFLEET_ROUTE_INDEX_SOURCE: decision.index_source,
                n.KVFLEET_ROUTE_CANDIDATES: [c.describe() for c in decision.candidates]})

    def start_dispatch(self, request_id: str, replica_id: str, address: str) -> tuple:
        """Open ``router.dispatch``; returns the gRPC metadata that carries its context."""
        self._dispatch_start = self.clock.now()
        if self.recording:
            self.span.set_attributes({n.KVFLEET_REQUEST_ID: request_id,
                                      n.KVFLEET_REPLICA_ID: replica_id})
        self._dispatch = self.tel.tracer.start_span(
            n.ROUTER_DISPATCH, context=trace.set_span_in_context(self.span), kind=SpanKind.CLIENT,
            start_time=self.clock.wall_ns(self._dispatch_start),
            attributes={n.RPC_SYSTEM: "grpc", n.SERVER_ADDRESS: address,
                        n.KVFLEET_REPLICA_ID: replica_id} if self.recording else None)
        return self.tel.inject(self._dispatch)

    def on_final(self, msg) -> None:
        """A sample's last message (finish reason, usage) as relayed to the client."""
        self._finish_reasons.append(_FINISH.get(msg.finish_reason, n.FINISH_ERROR))
        if self.recording:  # the request's summary lives on router.Generate only
            self.span.set_attributes({
                n.GEN_AI_USAGE_INPUT_TOKENS: msg.usage.prompt_tokens,
                n.GEN_AI_USAGE_OUTPUT_TOKENS: msg.usage.completion_tokens,
                n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: msg.usage.cached_prompt_tokens,
                n.KVFLEET_CACHED_PROMPT_TOKENS: msg.usage.cached_prompt_tokens})

    def dispatched(self, trailing_metadata) -> Optional[float]:
        """The worker stream ended OK: close ``router.dispatch``; returns the network seconds."""
        end = self.clock.now()
        dispatch_s = end - self._dispatch_start
        for key, value in trailing_metadata or ():
            if key == n.MD_WORKER_DURATION_S:
                try:
                    self.worker_s = float(value)
                except ValueError:
                    pass
        if self.worker_s is not None:
            self.network_s = dispatch_s - self.worker_s
            self.rt.network_duration.record(max(0.0, self.network_s),
                                            {n.GEN_AI_REQUEST_MODEL: self.model})
        span, self._dispatch = self._dispatch, None
        if span is not None and self.recording and self.network_s is not None:
            span.set_attributes({n.KVFLEET_WORKER_S: self.worker_s,
                                 n.KVFLEET_NETWORK_S: self.network_s})
        if span is not None:
            span.end(end_time=self.clock.wall_ns(end))
        return self.network_s

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata for the client: network and worker time, (when traced) the trace id."""
        out = []
        if self.network_s is not None:
            out.append((n.MD_NETWORK_S, f"{self.network_s:.6f}"))
            out.append((n.MD_WORKER_DURATION_S, f"{self.worker_s:.6f}"))
        ctx = self.span.get_span_context()
        if ctx.is_valid:
            out.append((n.MD_TRACE_ID, trace.format_trace_id(ctx.trace_id)))
        return tuple(out)

    def dispatch_failed(self, code: grpc.StatusCode, message: str) -> None:
        """The open ``router.dispatch`` failed before relaying anything and the request goes to
        another replica: end that span with the status (the next dispatch opens a new one)."""
        span, self._dispatch = self._dispatch, None
        if span is not None:
            if self.recording:
                set_failure(span, code, message, finish_reason_of_code(code))
            span.end(end_time=self.clock.wall_ns(self.clock.now()))

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Record the status the handler is about to abort with."""
        self._failure = (code, message)

    def http_status(self, status: int) -> None:
        """The HTTP response status (HTTP edge only)."""
        if self.recording:
            self.span.set_attribute(n.HTTP_RESPONSE_STATUS_CODE, status)

    # ---- end ----------------------------------------------------------------------------------
    def __enter__(self) -> "RouterRequestTrace":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        end = self.clock.now()
        failure = self._failure
        if exc_type is not None and failure is None:
            if issubclass(exc_type, (asyncio.CancelledError, GeneratorExit)):
                failure = (grpc.StatusCode.CANCELLED, "the client cancelled the call")
            elif not issubclass(exc_type, grpc.aio.AbortError):
                failure = (grpc.StatusCode.INTERNAL, f"{exc_type.__name__}")
        attrs = {n.GEN_AI_REQUEST_MODEL: self.model, n.GEN_AI_OPERATION_NAME: self.operation}
        if self.adapter:
            attrs[n.KVFLEET_ADAPTER] = self.adapter
        if failure is not None:
            attrs[n.ERROR_TYPE] = failure[0].name
            reason = finish_reason_of_code(failure[0])
            for span in (self._dispatch, self.span):
                if span is not None and self.recording:
                    set_failure(span, failure[0], failure[1], reason, server=span is self.span)
        elif self.recording:
            self.span.set_attribute(n.GEN_AI_RESPONSE_FINISH_REASONS, self._finish_reasons)
        if self._dispatch is not None:
            self._dispatch.end(end_time=self.clock.wall_ns(end))
            self._dispatch = None
        self.span.end(end_time=self.clock.wall_ns(end))
        self.rt.request_duration.record(end - self.start, attrs)

    def _child(self, name: str, start: float, end: float, attributes: dict) -> None:
        span = self.tel.tracer.start_span(name, context=trace.set_span_in_context(self.span),
                                          start_time=self.clock.wall_ns(start),
                                          attributes=attributes)
        span.end(end_time=self.clock.wall_ns(end))

