"""The router's transport-neutral request path: validate → tokenize → hash → route → relay.

Both edges call it — the gRPC ``Router.Generate`` handler (``router/server.py``) and the
OpenAI-compatible HTTP front (``router/http_front.py``) — on the one event loop that owns the
worker links and the index mirror. An edge authenticates (:meth:`RouterCore.authenticate`),
turns its request into a :class:`GenerateInput`, iterates :meth:`RouterCore.generate` and maps a
raised :class:`~kvfleet.errors.KvfleetError` to its own error shape.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncGenerator, Mapping, Optional, Sequence

import grpc

from kvfleet import priority
from kvfleet.allocator.hashing import block_hash_chain
from kvfleet.constraint import Constraint
from kvfleet.errors import (
    AlreadyExists,
    InvalidArgument,
    KvfleetError,
    NotFound,
    OutOfRange,
    PromptTooLarge,
    Unavailable,
)
from kvfleet.router.adapter_routing import adapter_revision, prefer_resident, serving
from kvfleet.router.auth import Authenticator
from kvfleet.router.capacity import (
    DEFAULT_RETRY_PUSHBACK_MS,
    check_class_room,
    check_room,
    fleet_capacity,
    with_room,
)
from kvfleet.router.peer_hint import pick_source, set_hint, tier_runs
from kvfleet.router.policy import Candidate, LeastLoaded, RoutingPolicy
from kvfleet.router.predicted_ttft import report_age
from kvfleet.router.prefix_index import IndexUnavailable
from kvfleet.router.replica_set import ReplicaSet
from kvfleet.router.served_model import ServedModel
from kvfleet.router.tenant_limits import TenantLimiter, request_service
from kvfleet.router.worker_link import DEFAULT_CALL_IDLE_S, LinkCall, WorkerCallError
from kvfleet.sampling_params import SamplingParams, check_context_length
from kvfleet.stream_limits import StreamLimits
from kvfleet.telemetry.router_spans import RouterRequestTrace, RouterTelemetry
from kvfleet.v1 import common_pb2

log = logging.getLogger(__name__)

MAX_PROMPT_BYTES = 1 << 20  # 1 MiB of prompt text per request (default)
# Dispatches of one request: the first, then retries on other replicas (a scale-down may
# drain two before this router's next registry read).
MAX_DISPATCHES = 3


@dataclass(frozen=True)
class PromptLimits:
    """Bounds on what one request may ask the router to tokenize (router flags), each refused
    with :class:`~kvfleet.errors.PromptTooLarge` (gRPC INVALID_ARGUMENT, HTTP 413) naming it.

    ``max_prompt_bytes``: UTF-8 bytes of text, or of all messages' content, per prompt;
    ``max_messages``: chat messages per prompt; ``max_prompts``: prompts per HTTP request
    (an array ``prompt``); ``tokenizer_threads``: threads tokenizing and templating off the
    event loop (streams keep flowing while a large prompt is tokenized).
    """

    max_prompt_bytes: int = MAX_PROMPT_BYTES
    max_messages: int = 1024
    max_prompts: int = 64
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_messages", "max_prompts", "tokenizer_threads"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: ``text``, ``token_ids`` or chat ``messages`` (``{"role", "content"}``)."""

    kind: str  # "text" | "token_ids" | "messages"
    text: str = ""
    token_ids: Sequence[int] = ()
    messages: Sequence[dict] = ()


@dataclass(frozen=True)
class GenerateInput:
    """One generation request as every edge describes it.

    ``fill_context``: ``sampling.max_tokens`` is ignored and becomes the rest of the context
    (bounded by the chosen replica's whole KV capacity): the OpenAI chat default.
    ``deadline_unix_s``: wall-clock deadline the worker enforces (None = none).
    """

    prompt: Prompt
    sampling: SamplingParams
    model: str = ""
    adapter: str = ""
    cache_salt: str = ""
    request_id: str = ""
    deadline_unix_s: Optional[float] = None
    fill_context: bool = False
    constraint: Optional[Constraint] = None  # structured output (validated by the edge)
    # kvfleet.priority number (lower runs first): the request's own, else its API key's
    # default (the edge resolves both); None = "default".
    priority: Optional[int] = None


@dataclass(frozen=True)
class RouteDecision:
    candidate: Candidate
    num_blocks: int
    redis_s: float      # seconds in the index lookup
    index_used: bool
    index_source: str = ""  # "mirror" (in memory), "redis" (a round trip), "" (not consulted)
    candidates: tuple[Candidate, ...] = ()  # every replica considered (span attribute)
    adapter: Optional[tuple[str, str]] = None  # LoRA (name, revision) the chain is keyed by
    tier_runs: Mapping[str, int] = field(default_factory=dict)  # node tier → leading blocks


class RouterCore:
    """Models, replicas, policy and auth of one router process, and the request path over them."""

    def __init__(self, models: dict[str, ServedModel], default_model: str, replicas: ReplicaSet,
                 policy: RoutingPolicy, auth: Authenticator,
                 telemetry: Optional[RouterTelemetry] = None,
                 retry_pushback_ms: int = DEFAULT_RETRY_PUSHBACK_MS,
                 stream_limits: StreamLimits = StreamLimits(),
                 call_idle_s: float = DEFAULT_CALL_IDLE_S,
                 prompt_limits: PromptLimits = PromptLimits(),
                 priority_admit: Optional[dict[str, float]] = None,

                 tenant_limiter: Optional[TenantLimiter] = None,
                 tenant_max_inflight: Optional[int] = None) -> None:
        self.models = models
        self.default_model = default_model
        self.replicas = replicas
        self.policy = policy
        self._blind = LeastLoaded()  # while the prefix index is unreachable
        self.auth = auth
        self.telemetry = telemetry or RouterTelemetry()  # spans + metrics (no-op by default)
        self.retry_pushback_ms = retry_pushback_ms  # RESOURCE_EXHAUSTED's retry hint (ms)
        self.stream_limits = stream_limits  # slow readers: the relay's bounds (both edges)
        self.call_idle_s = call_idle_s  # a worker call with no frame this long fails INTERNAL
        self.prompt_limits = prompt_limits
        # Per class: the fraction of fleet capacity past which its requests are refused.
        self.priority_admit = dict(priority_admit or priority.DEFAULT_ADMIT)
        priority.check_admit(self.priority_admit)
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(
            prompt_limits.tokenizer_threads, thread_name_prefix="kvfleet-tokenize")
        self._live_ids: set[tuple[str, str]] = set()  # (tenant, client request_id) in flight
        # Tenant limits, fleet-wide through Redis when the limiter has it (else this router's).
        self.tenant_limiter = tenant_limiter or TenantLimiter()
        # Limit of a tenant without its own in the key file (None: the key file's share only).
        self.tenant_max_inflight = tenant_max_inflight

    @property
    def tenant_inflight(self) -> collections.Counter[str]:
        """This router's open requests by tenant."""
        return self.tenant_limiter.inflight

    def tenant_limit(self, tenant: str, candidates: Sequence[Candidate]) -> Optional[int]:
        """In-flight requests ``tenant`` may hold across the fleet: the key file's own limit,
        else the smaller of its default share of the fleet's capacity and
        ``tenant_max_inflight`` (None: unlimited)."""
        limit = self.auth.tenant_limit(tenant, fleet_capacity(candidates))
        if self.tenant_max_inflight is None or tenant in self.auth.tenant_limits:
            return limit
        return self.tenant_max_inflight if limit is None else min(limit, self.tenant_max_inflight)

    def authenticate(self, metadata) -> str:
        """The tenant for gRPC metadata or HTTP headers (lower-case keys). Raises Unauthenticated."""
        return self.auth.tenant(metadata)

    def model(self, name: str) -> ServedModel:
        """The served model ``name`` (empty = the default). Raises NotFound."""
        model = self.models.get(name or self.default_model)
        if model is None:
            raise NotFound(f"model {name!r} is not served; served: {sorted(self.models)}",
                           field="model")
        return model

    def close(self) -> None:
        """Stop the tokenizer threads (after the edges stopped)."""
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    async def prompt_tokens(self, prompt: Prompt, model: ServedModel) -> list[int]:
        """Tokenize (or check) a prompt once, on the tokenizer threads. Raises InvalidArgument
        (PromptTooLarge past :class:`PromptLimits`; OutOfRange for more token ids than the
        context holds) naming the field."""
        limits = self.prompt_limits
        if prompt.kind == "text":
            if not prompt.text:
                raise InvalidArgument("text must not be empty", field="text")
            if len(prompt.text.encode()) > limits.max_prompt_bytes:
                raise PromptTooLarge(f"text exceeds the limit of {limits.max_prompt_bytes} "
                                     f"bytes per prompt (--max-prompt-bytes)", field="text")
            return await self._off_loop(model.encode_text, prompt.text)
        if prompt.kind == "token_ids":
            if len(prompt.token_ids) > model.max_context:  # before any pass over them
                raise OutOfRange(f"token_ids: {len(prompt.token_ids)} tokens exceed the context "
                                 f"of {model.max_context} tokens", field="token_ids")
            # One copy to a list: reading a protobuf repeated field creates every int again
            # on each pass, and min, max and the block hashing each make a pass.
            ids = list(prompt.token_ids)
            if not ids:
                raise InvalidArgument("token_ids must not be empty", field="token_ids")
            if min(ids) < 0 or max(ids) >= model.vocab_size:
                bad = next(t for t in ids if not 0 <= t < model.vocab_size)
                raise InvalidArgument(f"token_ids: {bad} is outside [0, {model.vocab_size})",
                                      field="token_ids")
            return ids
        if prompt.kind == "messages":
            if len(prompt.messages) > limits.max_messages:
                raise PromptTooLarge(f"messages: {len(prompt.messages)} exceed the limit of "
                                     f"{limits.max_messages} per prompt (--max-messages)",
                                     field="messages")
            if sum(len(m["content"].encode()) for m in prompt.messages) > limits.max_prompt_bytes:
                raise PromptTooLarge(f"messages exceed the limit of {limits.max_prompt_bytes} "
                                     f"bytes of content per prompt (--max-prompt-bytes)",
                                     field="messages")
            return await self._off_loop(model.encode_messages, prompt.messages)
        raise InvalidArgument("prompt: one of text, token_ids or messages is required",
                              field="prompt")

    async def _off_loop(self, fn, arg):
        # Tokenizing a large prompt takes long: on the loop it would stall every stream it relays.
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, arg)

    def _candidates(self, model: str, matched: Optional[dict[str, int]] = None,
                    live: Optional[list] = None, host: Optional[dict[str, int]] = None,
                    tenant: Optional[str] = None) -> list[Candidate]:
        """Every live replica of ``model`` with its load (``live``: ``for_model``'s answer, if
        the caller has it; ``matched`` / ``host``: its device / host-tier hits; ``tenant``:
        the request's, for the tenant spread's counts). Raises Unavailable if none is live."""
        live = self.replicas.for_model(model) if live is None else live
        if not live:
            raise Unavailable(self.replicas.none_reason(model))
        ledger, matched, host = self.replicas.ledger, matched or {}, host or {}
        spread = {} if tenant is None else ledger.tenant_spread(tenant)
        now = ledger.clock()
        return [Candidate(info, load, matched.get(info.replica_id, 0),
                          ledger.inflight[info.replica_id], ledger.settled(info.replica_id),
                          report_age(load, now), host.get(info.replica_id, 0),
                          spread.get(info.replica_id, 0))
                for info, load in live]

    def _claim_id(self, tenant: str, client_id: str) -> tuple[str, str]:
        """(the client's id or a new one, the id the worker sees: that one namespaced by
        tenant, so two tenants may both use "req-1"). Raises AlreadyExists for an id live for
        the same tenant on this router; a claimed id is released by :meth:`generate`."""
        if not client_id:
            client_id = uuid.uuid4().hex
        elif (tenant, client_id) in self._live_ids:
            raise AlreadyExists(f"request_id {client_id!r} is already live for this tenant",
                                field="request_id")
        else:
            self._live_ids.add((tenant, client_id))
        return client_id, f"{tenant}/{client_id}"

    async def route(self, model: ServedModel, chain: list[bytes],
                    adapter: Optional[tuple[str, str]] = None,
                    tenant: Optional[str] = None) -> RouteDecision:
        """Pick a replica with room for a chain of block hashes (``adapter``: (name,
        revision), among the replicas serving it; ``prefix_aware`` prefers those where it is
        resident; ``tenant``: the request's, spread when light). Raises Unavailable if none
        is live."""
        live = self._candidates(model.name)  # Unavailable before any lookup
        matched: dict[str, int] = {}
        host: dict[str, int] = {}
        runs: dict[str, int] = {}
        t0 = time.perf_counter()
        index_used, source = False, ""
        # During an outage skip the lookup (each would wait for a timeout): route by load until
        # the background refresh sees Redis answer again.
        if chain and getattr(self.policy, "uses_index", False) and self.replicas.index_available:
            source = "mirror" if self.replicas.index.local else "redis"
            try:
                matched = await self.replicas.index.match(chain)
                # Replicas with a node tier: the blocks after their device match it holds.
                starts = {c.info.replica_id: (c.info.kv_tier, matched.get(c.info.replica_id, 0))
                          for c in live if c.info.kv_tier}
                if starts:
                    host = await self.replicas.index.host_match(chain, starts)
                runs = await tier_runs(self.replicas.index, chain)  # any tier: a pull source
                index_used = True
                self.replicas.mark_index_up()
            except IndexUnavailable as exc:
                self.replicas.mark_index_down(exc)
        redis_s = time.perf_counter() - t0
        candidates = self._candidates(model.name, matched, host=host, tenant=tenant)
        if adapter is not None:
            candidates = serving(candidates, adapter)
            if not candidates:
                raise Unavailable(f"no live replica serves adapter {adapter[0]!r}")
        roomy = with_room(candidates)
        if adapter is not None and getattr(self.policy, "uses_index", False):
            roomy = prefer_resident(roomy, adapter[0])
        if chain and getattr(self.policy, "uses_index", False) and not index_used:
            # No prefix is known anywhere: by load alone, equal loads in turn (a hash of the
            # chain would send an idle fleet's requests all to one replica).
            chosen = self._blind.choose(roomy, ())
        else:
            chosen = self.policy.choose(roomy, chain)
        return RouteDecision(chosen, len(chain), redis_s, index_used,
                             source if index_used else "", tuple(candidates), adapter, runs)

    async def generate(self, req: GenerateInput, tenant: str, trace: RouterRequestTrace
                       ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        """Validate, tokenize, route and relay one request; yields the worker's messages.

        Raises:
            KvfleetError: before the first message (validation, NOT_FOUND, UNAVAILABLE, …) or
                after it (:class:`~kvfleet.router.worker_link.WorkerCallError`: the worker's
                status). The caller records it on ``trace`` and answers it in its own shape.
        """
        model = self.model(req.model)
        level = priority.resolve(req.priority, None)  # the edge applied the key's default
        if req.priority is None:
            req = replace(req, priority=level)
        # A stale view with no routable replica re-reads the registry first.
        candidates = self._candidates(model.name, live=await self.replicas.routable(model.name))
        # Before tokenizing (cheap: one Redis call when limited); reserved at the check, so a
        # burst cannot all pass it across the awaits below.
        lease = await self.tenant_limiter.acquire(tenant, self.tenant_limit(tenant, candidates))
        service = 0.0  # the tenant's weighted tokens, for the fleet's account
        try:
            adapter = None
            if req.adapter:
                self.auth.check_adapter(tenant, req.adapter)
                adapter = (req.adapter, adapter_revision([c.info for c in candidates], req.adapter,
                                                         model.name))
                candidates = serving(candidates, adapter)
            check_room(candidates, model.name, level)
            check_class_room(candidates, model.name, level, self.priority_admit)
            params = req.sampling.check_vocab(model.vocab_size)
            trace.on_request(model.name, params, tenant, req.adapter, level)
            with trace.tokenize() as tokenized:
                tokens = await self.prompt_tokens(req.prompt, model)
                tokenized["tokens"] = len(tokens)
            if not req.fill_context:
                self._check_context(model, len(tokens), params.max_tokens)
            route_start = time.monotonic()
            scope = self.auth.cache_scope(tenant)  # the tenant, or its shared namespace
            chain = block_hash_chain(model.root_hash(scope, req.cache_salt, adapter), tokens,
                                     model.block_size)
            decision = await self.route(model, chain, adapter, tenant)
            trace.routed(route_start, decision, self.policy.name)
            client_id, request_id = self._claim_id(tenant, req.request_id)  # last: released below
            try:
                # aclosing: an edge that closes this generator closes the relay at once (ledger,
                # worker call), not whenever the garbage collector finalizes it.
                async with contextlib.aclosing(self._dispatch(
                        req, trace, model, chain, decision, (client_id, request_id), params,
                        tokens, scope)) as relay:
                    async for msg in relay:
                        if msg.finish_reason:
                            u = msg.usage
                            service += request_service(u.prompt_tokens, u.cached_prompt_tokens,
                                                       u.completion_tokens)
                        yield msg
            finally:
                self._live_ids.discard((tenant, req.request_id))
        finally:
            self.tenant_limiter.release(lease, service)  # done, failed or cancelled

    async def _dispatch(self, req: GenerateInput, trace, model: ServedModel, chain, decision,
                        ids: tuple[str, str], params: SamplingParams, tokens, scope: str
                        ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        """Relay the chosen replica's stream; moved to another replica (up to
        ``MAX_DISPATCHES`` in all) when the link failed or the replica refused UNAVAILABLE
        (draining, a failed rank) before anything was relayed. ``ids``: (the client's request
        id, the worker's)."""
        client_id, request_id = ids
        tenant = request_id.partition("/")[0]  # see _claim_id
        for attempt in range(1, MAX_DISPATCHES + 1):
            info = decision.candidate.info
            if req.fill_context:
                params = self._fill_context(model, len(tokens), params, decision.candidate)
            call = self._worker_call(req, request_id, params, tokens, scope, info, trace)
            peer = pick_source(decision.candidates, decision.candidate, decision.tier_runs)
            if peer is not None:  # routed away from a longer match: the replica may pull it
                set_hint(call.request, peer, decision.candidate)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: %d tokens → %s (%s); candidates: %s", request_id,
                          len(tokens), info.replica_id, self.policy.name,
                          "; ".join(c.describe() for c in decision.candidates))
            relayed = False
            dispatched_at = self.replicas.ledger.dispatched(info.replica_id, tenant)
            # The deadline travels as deadline_unix_s (the worker enforces it); an edge that
            # gives up cancels this generator, which cancels the call below.
            try:
                async for msg in call:
                    relayed = True
                    msg.request_id = client_id  # the worker's carries the tenant
                    if msg.finish_reason:
                        trace.on_final(msg)
                    yield msg
                trace.dispatched(call.trailing_metadata())
                return
            except WorkerCallError as exc:
                if exc.link_failed or exc.code == grpc.StatusCode.UNAVAILABLE:
                    self.replicas.mark_unreachable(info)
                    retry = None
                    # Nothing reached the client: safe to move.
                    if not relayed and attempt < MAX_DISPATCHES:
                        with contextlib.suppress(KvfleetError):
                            retry = await self.route(model, chain, decision.adapter, tenant)
                            chosen = retry.candidate.info
                            if (chosen.replica_id == info.replica_id
                                    or self.replicas.is_unreachable(chosen)):
                                # Nowhere reachable known (every known replica failed lately):
                                # a replacement may have registered since the last registry
                                # read (every 0.5 s); read it now.
                                await self.replicas.refresh()
                                retry = await self.route(model, chain, decision.adapter, tenant)
                        if retry is not None and retry.candidate.info.replica_id != info.replica_id:
                            trace.dispatch_failed(exc.code, exc.details)
                            decision = retry
                            continue
                raise
            finally:
                self.replicas.ledger.finished(info.replica_id, dispatched_at, tenant)
                call.cancel()  # no-op when finished; aborts the worker's call if the client left

    @staticmethod
    def _check_context(model: ServedModel, num_tokens: int, max_tokens: int) -> None:
        check_context_length(num_tokens + max_tokens, model.max_context,
                             f"prompt ({num_tokens} tokens) + sampling.max_tokens ({max_tokens})",
                             field="sampling.max_tokens")

    @staticmethod
    def _fill_context(model: ServedModel, num_tokens: int, params: SamplingParams,
                      chosen: Candidate) -> SamplingParams:
        """``params`` with max_tokens = what is left of the context after the prompt, and of
        the chosen replica's whole KV capacity (its last report), so that it can ever fit."""
        limit = model.max_context
        report = chosen.load_report
        if report is not None and report.num_total_blocks > 0:
            limit = min(limit, report.num_total_blocks * model.block_size)
        if num_tokens >= limit:
            raise OutOfRange(f"prompt ({num_tokens} tokens) leaves no room to generate within "
                             f"the context of {limit} tokens", field="messages")
        return replace(params, max_tokens=limit - num_tokens)

    def _worker_call(self, req: GenerateInput, request_id: str, params: SamplingParams,
                     tokens: Sequence[int], scope: str, info, trace) -> LinkCall:
        """The worker request for one dispatch to ``info``, ready to iterate."""
        call = self.replicas.link(info).call(
            trace.start_dispatch(request_id, info.replica_id, info.address),
            max_unread=self.stream_limits.max_unread, idle_s=self.call_idle_s)
        worker_req = call.request  # filled in place: no copy of the prompt into the frame
        worker_req.request_id, worker_req.cache_scope = request_id, scope
        # Fairness counts tenants, not scopes; the id is "<tenant>/<id>" (tenants hold no "/").
        worker_req.tenant = request_id.partition("/")[0]
        worker_req.cache_salt, worker_req.adapter = req.cache_salt, req.adapter
        worker_req.prompt_token_ids.extend(tokens)
        if req.priority is not None:
            worker_req.priority = req.priority
        params.to_proto(worker_req.sampling)
        if req.constraint is not None:
            req.constraint.to_proto(worker_req)
        if req.deadline_unix_s is not None:
            worker_req.deadline_unix_s = req.deadline_unix_s
        return call
