"""The worker's spans and metrics for one ``Worker.Generate`` call.

    worker.Generate (SERVER, parent: router.dispatch's context from gRPC metadata)
      ├─ worker.queue    arrival → first scheduled (inbox wait + the scheduler's waiting queue)
      ├─ worker.prefill  first scheduled → first token (prompt / cached tokens, chunk events)
      └─ worker.decode   first token → finished (output tokens, first-token event)

The phase spans are built on the event loop, after the fact, from the monotonic milestones the
engine reports with each sample's last output (:class:`~kvfleet.worker.outputs.Milestones`):
nothing runs in the engine's step loop and no span is created per token. ``worker.Generate``
ends when both the handler has returned and the engine has finished the request, so a
cancelled request's spans still carry the engine's finish (``finish_reason=cancelled``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Collection, Optional

import grpc
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind

from kvfleet import priority
from kvfleet.telemetry import names as n
from kvfleet.telemetry.provider import Telemetry
from kvfleet.telemetry.status import set_failure
from kvfleet.telemetry.tier_metrics import register_pull_metrics, register_tier_metrics

log = logging.getLogger(__name__)

_ABNORMAL = {"cancelled": grpc.StatusCode.CANCELLED, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
             "error": grpc.StatusCode.INTERNAL}
MAX_CHUNK_EVENTS = 64
ORPHAN_TIMEOUT_S = 30.0  # handler gone and the engine silent this long: end the spans anyway


class WorkerTelemetry:
    """Instruments of one replica; :meth:`start` traces one call, :meth:`on_finished` is the
    engine loop's hook for every sample's last output (called on the event loop)."""

    def __init__(self, telemetry: Optional[Telemetry] = None, replica_id: str = "",
                 model: str = "", stats_fn: Optional[Callable[[], dict]] = None,
                 adapters_fn: Callable[[], Collection[str]] = tuple,
                 step_cost: Any = None,
                 pull_stats_fn: Optional[Callable[[], Any]] = None) -> None:
        self.telemetry = telemetry or Telemetry.disabled("worker")
        self.replica_id = replica_id
        self.model = model
        self.adapters_fn = adapters_fn  # the configured adapters: the only adapter label values
        self._stats_fn = stats_fn
        self._open: dict[str, WorkerRequestTrace] = {}
        m = self.telemetry.meter
        self.ttft = m.create_histogram(
            n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, unit="s",
            description="Worker: request arrival to its first output token",
            explicit_bucket_boundaries_advisory=n.TTFT_BUCKETS_S)
        self.tpot = m.create_histogram(
            n.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN, unit="s",
            description="Worker: decode time per output token after the first (one per request)",
            explicit_bucket_boundaries_advisory=n.TPOT_BUCKETS_S)
        hist = lambda name, what: m.create_histogram(  # noqa: E731
            name, unit="s", description=what, explicit_bucket_boundaries_advisory=n.DURATION_BUCKETS_S)
        self.duration = hist(n.METRIC_WORKER_REQUEST_DURATION, "Worker: arrival to finish")
        self.queue = hist(n.METRIC_QUEUE_DURATION, "Worker: arrival to first scheduled")
        self.prefill = hist(n.METRIC_PREFILL_DURATION, "Worker: first scheduled to first token")
        self.decode = hist(n.METRIC_DECODE_DURATION, "Worker: first token to finish")
        self.prompt_tokens = m.create_counter(n.METRIC_PROMPT_TOKENS, unit="{token}",
                                              description="Prompt tokens of finished requests")
        self.hit_tokens = m.create_counter(
            n.METRIC_PREFIX_HIT_TOKENS, unit="{token}",
            description="Prompt tokens reused from the prefix cache (not computed)")
        self.output_tokens = m.create_counter(n.METRIC_OUTPUT_TOKENS, unit="{token}",
                                              description="Generated tokens")
        self.spec_drafted = m.create_counter(
            n.METRIC_SPEC_DRAFTED, unit="{token}",
            description="Speculative decoding: draft tokens verified (finished requests)")
        self.spec_accepted = m.create_counter(
            n.METRIC_SPEC_ACCEPTED, unit="{token}",
            description="Speculative decoding: draft tokens accepted (finished requests)")
        self.spec_acceptance = m.create_histogram(
            n.METRIC_SPEC_ACCEPTANCE, unit="1",
            description="Speculative decoding: accepted ÷ drafted tokens of each request that drafted",
            explicit_bucket_boundaries_advisory=n.SPEC_ACCEPTANCE_BUCKETS)
        if stats_fn is not None:
            m.create_observable_gauge(n.METRIC_KV_CACHE_USAGE, [self._kv_usage], unit="1",
                                      description="Fraction of KV blocks referenced by live requests")
            m.create_observable_gauge(n.METRIC_REQUESTS, [self._requests], unit="{request}",
                                      description="Requests running / waiting in the engine")
            m.create_observable_counter(
                n.METRIC_TENANT_SERVICE, [self._tenant_service], unit="{token}",
                description="Service per tenant: weighted prefill tokens computed (prefix-cache "
                            "hits free) + decode tokens, as the scheduler's fairness counts it")
            m.create_observable_gauge(
                n.METRIC_QUEUE_DELAY, [self._queue_delay], unit="s",
                description="Predicted wait before a request arriving now starts its prefill")
            m.create_observable_counter(
                n.METRIC_NESTED_STEPS, [self._nested_steps], unit="{step}",
                description="Layer yield: steps run while a lower class's forward paused")
            m.create_observable_counter(
                n.METRIC_PREEMPTIONS, [self._preemptions], unit="{sequence}",
                description="Sequences preempted by recompute, by reason: blocks (memory), class "
                            "(a higher class's seat or blocks), tenant_seat (a tenant behind)")
            m.create_observable_counter(
                n.METRIC_REPLICA_TIME, [self._replica_time], unit="s",
                description="Forward seconds charged to each priority class's rows (each step's "
                            "measured seconds shared among its rows by their modelled cost)")
            register_tier_metrics(m, model, stats_fn)
        if pull_stats_fn is not None:  # -> the replica's PullStats, or None (no puller)
            register_pull_metrics(m, model, pull_stats_fn)
        self._step_cost = step_cost  # the engine's StepCost (kvfleet.worker.step_cost.model)
        if step_cost is not None:
            self._step_instruments(m)

    # ---- per request -----------------------------------------------------------------------
    def start(self, request, metadata) -> "WorkerRequestTrace":
        """Open ``worker.Generate`` for a proto WorkerGenerateRequest; register its request id."""
        rt = WorkerRequestTrace(self, request, metadata)
        if rt.request_id and rt.request_id not in self._open:
            self._open[rt.request_id] = rt  # a duplicate id is refused by the engine anyway
        return rt

    def on_finished(self, out) -> None:
        """Engine-loop hook: a sample's last :class:`SeqOutput` (consumed by a stream or not)."""
        rt = self._open.get(out.request_id)
        if rt is not None:
            try:
                rt.on_final(out)
            except Exception:
                log.exception("telemetry for %s failed", out.request_id)

    def _forget(self, rt: "WorkerRequestTrace") -> None:
        if self._open.get(rt.request_id) is rt:
            del self._open[rt.request_id]

    # ---- gauges ------------------------------------------------------------------------------
    def _step_instruments(self, m) -> None:
        """Predicted vs measured forward time, cumulative (read from the step-cost model)."""
        counter = lambda name, attr, unit, what: m.create_observable_counter(  # noqa: E731
            name, [lambda _o: self._step_value(attr)], unit=unit, description=what)
        counter(n.METRIC_STEP_PREDICTED, "predicted_total_s", "s",
                "Engine forwards: seconds the step-cost model predicted (before the step)")
        counter(n.METRIC_STEP_MEASURED, "measured_total_s", "s", "Engine forwards: seconds measured")
        counter(n.METRIC_STEPS, "steps", "{step}", "Engine forwards timed")
        m.create_observable_gauge(n.METRIC_STEP_COST_SCALE, [self._step_scales], unit="1",
                                  description="Online correction per side of the step (decode: "
                                              "base, rows, context; prefill: tokens): measured ÷ "
                                              "calibrated")

    def _step_value(self, attr: str):
        yield metrics.Observation(getattr(self._step_cost, attr), {n.GEN_AI_REQUEST_MODEL: self.model})

    def _step_scales(self, _options):
        for side in ("decode", "prefill"):
            yield metrics.Observation(getattr(self._step_cost, f"{side}_scale"),
                                      {n.GEN_AI_REQUEST_MODEL: self.model, n.KVFLEET_STEP_SIDE: side})

    def _kv_usage(self, _options):
        s = self._stats_fn()
        total = s.get("num_total_blocks", 0)
        used = total - s.get("num_free_blocks", 0)
        yield metrics.Observation(used / total if total else 0.0, {n.GEN_AI_REQUEST_MODEL: self.model})

    def _tenant_service(self, _options):
        # Tenants the scheduler keeps: backlogged ones and those ahead of them (bounded).
        for tenant, service in self._stats_fn().get("tenant_service", {}).items():
            yield metrics.Observation(service, {n.KVFLEET_TENANT: tenant,
                                                n.GEN_AI_REQUEST_MODEL: self.model})

    def _queue_delay(self, _options):
        delay = self._stats_fn().get("queue_delay_s")
        if delay is not None:
            yield metrics.Observation(delay, {n.GEN_AI_REQUEST_MODEL: self.model})

    def _nested_steps(self, _options):
        yield metrics.Observation(self._stats_fn().get("nested_steps", 0),
                                  {n.GEN_AI_REQUEST_MODEL: self.model})

    def _preemptions(self, _options):
        for reason, count in self._stats_fn().get("preemptions", {}).items():
            yield metrics.Observation(count, {n.KVFLEET_PREEMPT_REASON: reason,
                                              n.GEN_AI_REQUEST_MODEL: self.model})

    def _replica_time(self, _options):
        for klass, seconds in self._stats_fn().get("replica_s_by_class", {}).items():
            yield metrics.Observation(seconds, {n.KVFLEET_PRIORITY_CLASS: klass,
                                                n.GEN_AI_REQUEST_MODEL: self.model})

    def _requests(self, _options):
        s = self._stats_fn()
        for state in ("running", "waiting"):
            yield metrics.Observation(s.get(state, 0), {n.KVFLEET_REQUEST_STATE: state,
                                                        n.GEN_AI_REQUEST_MODEL: self.model})


class WorkerRequestTrace:
    """Spans and metrics of one request on the worker; see the module docstring."""

    def __init__(self, wt: WorkerTelemetry, request, metadata) -> None:
        self.wt = wt
        self.tel = wt.telemetry
        self.clock = self.tel.clock
        self.start = self.clock.now()
        self.request_id = request.request_id
        self.n = request.sampling.n if request.sampling.HasField("n") and request.sampling.n > 0 else 1
        self.adapter = request.adapter
        self.priority = request.priority if request.HasField("priority") else priority.DEFAULT
        self.finals: list = []
        self.handler_end: Optional[float] = None
        self._failure: Optional[tuple[grpc.StatusCode, str]] = None
        self._done = False
        self._timer: Optional[asyncio.TimerHandle] = None
        self.span = self.tel.tracer.start_span(
            n.WORKER_GENERATE, context=self.tel.extract(metadata), kind=SpanKind.SERVER,
            start_time=self.clock.wall_ns(self.start))
        self.recording = self.span.is_recording()
        if self.recording:
            # Few attributes on purpose: encoding them dominates what tracing costs per request.
            attrs = {n.RPC_SYSTEM: "grpc", n.GEN_AI_REQUEST_MODEL: wt.model,
                     n.KVFLEET_REQUEST_ID: self.request_id, n.KVFLEET_REPLICA_ID: wt.replica_id,
                     n.GEN_AI_USAGE_INPUT_TOKENS: len(request.prompt_token_ids),
                     n.KVFLEET_PRIORITY: self.priority}
            if self.n != 1:
                attrs[n.GEN_AI_REQUEST_CHOICE_COUNT] = self.n
            if request.adapter:
                attrs[n.KVFLEET_ADAPTER] = request.adapter
            if request.sampling.HasField("max_tokens"):
                attrs[n.GEN_AI_REQUEST_MAX_TOKENS] = request.sampling.max_tokens
            self.span.set_attributes(attrs)

    def __enter__(self) -> "WorkerRequestTrace":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.handler_done(exc_type)

    def refused(self, code: grpc.StatusCode, message: str) -> None:
        """The request never reached the engine (or failed before any output)."""
        self._failure = (code, message)
        self.n = len(self.finals)  # nothing more will come

    def handler_done(self, exc_type=None) -> float:
        """The handler returns (``exc_type`` when it was interrupted); returns its duration (s)."""
        if self.handler_end is None:
            self.handler_end = self.clock.now()
            if exc_type is not None and self._failure is None and len(self.finals) < self.n:
                if issubclass(exc_type, (asyncio.CancelledError, GeneratorExit)):
                    self._failure = (grpc.StatusCode.CANCELLED, "the caller cancelled the call")
            if len(self.finals) >= self.n:
                self._finish()
            else:  # the engine reports the abort at its next step; don't wait for ever
                self._timer = asyncio.get_running_loop().call_later(ORPHAN_TIMEOUT_S, self._finish)
        return self.handler_end - self.start

    def on_final(self, out) -> None:
        self.finals.append(out)
        if len(self.finals) == self.n:
            self._record_metrics()
            if self.handler_end is not None:
                self._finish()

    # ---- building -----------------------------------------------------------------------------
    def _phases(self):
        """(first_scheduled, first_token, finished) over all samples; None where never reached."""
        ms = [o.milestones for o in self.finals if o.milestones is not None]
        sched = [m.first_scheduled for m in ms if m.first_scheduled is not None]
        first = [m.first_token for m in ms if m.first_token is not None]
        finished = max((m.finished for m in ms), default=None)
        return (min(sched) if sched else None, min(first) if first else None, finished)

    def _reasons(self) -> list[str]:
        return [o.finish_reason.value for o in self.finals if o.finish_reason is not None]

    def _record_metrics(self) -> None:
        wt = self.wt
        sched, first, finished = self._phases()
        if finished is None:
            return
        reasons = self._reasons()
        abnormal = next((r for r in reasons if r in _ABNORMAL), None)
        attrs = {n.GEN_AI_REQUEST_MODEL: wt.model}
        if self.adapter and self.adapter in wt.adapters_fn():
            attrs[n.KVFLEET_ADAPTER] = self.adapter
        if abnormal is not None:
            attrs = {**attrs, n.ERROR_TYPE: _ABNORMAL[abnormal].name}
        wt.duration.record(finished - self.start, attrs)
        wt.queue.record((sched or finished) - self.start, attrs)
        if sched is not None:
            wt.prefill.record((first or finished) - sched, attrs)
        if first is not None:
            wt.decode.record(finished - first, attrs)
        usage = [o.usage for o in self.finals if o.usage is not None]
        wt.prompt_tokens.add(sum(u.prompt_tokens for u in usage), attrs)
        wt.hit_tokens.add(sum(u.cached_prompt_tokens for u in usage), attrs)
        wt.output_tokens.add(sum(u.completion_tokens for u in usage), attrs)
        drafted, accepted = self._speculated()
        if drafted:
            wt.spec_drafted.add(drafted, attrs)
            wt.spec_accepted.add(accepted, attrs)
            wt.spec_acceptance.record(accepted / drafted, attrs)
        if abnormal is None and first is not None:  # GenAI conventions: successful responses
            # Per class (a bounded label): whether the classes' latency targets hold.
            by_class = {**attrs, n.KVFLEET_PRIORITY_CLASS: priority.label(self.priority)}
            wt.ttft.record(first - self.start, by_class)
            tpot = self._tpot()
            if tpot is not None:
                wt.tpot.record(tpot, by_class)

    def _speculated(self) -> tuple[int, int]:
        """Speculative drafts verified and accepted over the request's samples."""
        ms = [o.milestones for o in self.finals if o.milestones is not None]
        return sum(m.spec_drafted for m in ms), sum(m.spec_accepted for m in ms)

    def _tpot(self) -> Optional[float]:
        o = self.finals[0]
        m = o.milestones
        if m is None or o.usage is None or o.usage.completion_tokens < 2 or m.first_token is None:
            return None
        return ((m.last_token or m.first_token) - m.first_token) / (o.usage.completion_tokens - 1)

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        self.wt._forget(self)
        sched, first, finished = self._phases()
        end = max(self.handler_end or self.clock.now(), finished or 0.0)
        if self.recording:
            self._build_spans(sched, first, finished)
        self.span.end(end_time=self.clock.wall_ns(end))

    def _build_spans(self, sched, first, finished) -> None:
        reasons = self._reasons()
        abnormal = next((r for r in reasons if r in _ABNORMAL), None)
        failure = self._failure
        if failure is None and abnormal is not None:
            failure = (_ABNORMAL[abnormal], f"request ended: {abnormal}")
        usage = self.finals[0].usage if self.finals and self.finals[0].usage else None
        if usage is not None:  # prompt tokens were set at start; cached ones are on prefill
            self.span.set_attribute(n.GEN_AI_USAGE_OUTPUT_TOKENS, sum(
                o.usage.completion_tokens for o in self.finals if o.usage))
        phases: list[tuple] = []  # (name, start, end, attributes, events)
        if finished is not None:
            phases.append((n.WORKER_QUEUE, self.start, sched or finished, {}, ()))
            if sched is not None:
                phases.append(self._prefill_phase(sched, first or finished, usage))
            if first is not None:
                phases.append(self._decode_phase(first, finished))
        reason = ""
        if failure is not None:
            reason = abnormal or ("cancelled" if failure[0] == grpc.StatusCode.CANCELLED else "error")
            set_failure(self.span, failure[0], failure[1], reason, server=True)
        else:
            self.span.set_attribute(n.GEN_AI_RESPONSE_FINISH_REASONS, reasons)
        parent = trace.set_span_in_context(self.span)
        for i, (name, start, stop, attributes, events) in enumerate(phases):
            span = self.tel.tracer.start_span(name, context=parent, attributes=attributes,
                                              start_time=self.clock.wall_ns(start))
            for event, event_attrs, at in events:
                span.add_event(event, event_attrs, timestamp=self.clock.wall_ns(at))
            if failure is not None and i == len(phases) - 1:  # the phase it ended in
                set_failure(span, failure[0], failure[1], reason)
            span.end(end_time=self.clock.wall_ns(stop))

    def _prefill_phase(self, start: float, end: float, usage):
        m = self.finals[0].milestones
        chunks = m.prefill_chunks if m is not None else ()
        cached = usage.cached_prompt_tokens if usage else 0
        attrs = {n.KVFLEET_PREFILL_CHUNKS: len(chunks),
                 n.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens if usage else 0,
                 n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
                 n.KVFLEET_CACHED_PROMPT_TOKENS: cached}
        events = [(n.EVENT_PREFILL_CHUNK, {n.KVFLEET_CHUNK_TOKENS: tokens}, at)
                  for at, tokens in chunks[:MAX_CHUNK_EVENTS]]
        return n.WORKER_PREFILL, start, end, attrs, events

    def _decode_phase(self, start: float, end: float):
        attrs = {n.GEN_AI_USAGE_OUTPUT_TOKENS: sum(o.usage.completion_tokens
                                                   for o in self.finals if o.usage),
                 n.KVFLEET_TTFT_S: start - self.start}
        tpot = self._tpot()
        if tpot is not None:
            attrs[n.KVFLEET_TPOT_S] = tpot
        drafted, accepted = self._speculated()
        if drafted:
            attrs[n.KVFLEET_SPEC_DRAFTED] = drafted
            attrs[n.KVFLEET_SPEC_ACCEPTED] = accepted
        return n.WORKER_DECODE, start, end, attrs, [(n.EVENT_FIRST_TOKEN, {}, start)]
