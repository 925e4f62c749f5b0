"""The Router gRPC service: authenticate → validate → tokenize → hash → route → relay."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

import grpc

from kvfleet.allocator.hashing import block_hash_chain
from kvfleet.errors import (AlreadyExists, InvalidArgument, KvfleetError, NotFound, OutOfRange,
                            Unavailable, status_of)
from kvfleet.router.auth import Authenticator
from kvfleet.router.capacity import (DEFAULT_RETRY_PUSHBACK_MS, RETRY_PUSHBACK_KEY, check_room,
                                     check_tenant, fleet_capacity, with_room)
from kvfleet.router.policy import Candidate, RoutingPolicy
from kvfleet.router.prefix_index import IndexUnavailable
from kvfleet.router.replica_set import ReplicaSet
from kvfleet.router.served_model import ServedModel
from kvfleet.router.worker_link import LinkCall, WorkerCallError
from kvfleet.sampling_params import SamplingParams
from kvfleet.telemetry.router_spans import RouterTelemetry
from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

MAX_PROMPT_BYTES = 1 << 20  # 1 MiB of prompt text per request


@dataclass(frozen=True)
class RouteDecision:
    candidate: Candidate
    num_blocks: int
    redis_s: float      # seconds in the index lookup
    index_used: bool
    index_source: str = ""  # "mirror" (in memory), "redis" (a round trip), "" (not consulted)
    candidates: tuple[Candidate, ...] = ()  # every replica considered (span attribute)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, models: dict[str, ServedModel], default_model: str, replicas: ReplicaSet,
                 policy: RoutingPolicy, auth: Authenticator,
                 telemetry: Optional[RouterTelemetry] = None,
                 retry_pushback_ms: int = DEFAULT_RETRY_PUSHBACK_MS) -> None:
        self.models = models
        self.default_model = default_model
        self.replicas = replicas
        self.policy = policy
        self.auth = auth
        self.telemetry = telemetry or RouterTelemetry()  # spans + metrics (no-op by default)
        self.retry_pushback_ms = retry_pushback_ms  # RESOURCE_EXHAUSTED's retry hint
        self._live_ids: set[tuple[str, str]] = set()  # (tenant, client request_id) in flight
        self.tenant_inflight: collections.Counter[str] = collections.Counter()

    # ---- helpers -------------------------------------------------------------------------
    def _model(self, name: str) -> ServedModel:
        model = self.models.get(name or self.default_model)
        if model is None:
            raise NotFound(f"model {name!r} is not served; served: {sorted(self.models)}")
        return model

    def _prompt_tokens(self, request, model: ServedModel) -> Sequence[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidArgument("prompt: one of text, token_ids or messages is required")
        if kind == "text":
            if not request.text:
                raise InvalidArgument("text must not be empty")
            if len(request.text.encode()) > MAX_PROMPT_BYTES:
                raise InvalidArgument(f"text exceeds {MAX_PROMPT_BYTES} bytes")
            return model.encode_text(request.text)
        if kind == "token_ids":
            # One copy to a list: reading a protobuf repeated field creates every int again
            # on each pass, and min, max and the block hashing each make a pass.
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidArgument("token_ids must not be empty")
            if min(ids) < 0 or max(ids) >= model.vocab_size:
                bad = next(t for t in ids if not 0 <= t < model.vocab_size)
                raise InvalidArgument(f"token_ids: {bad} is outside [0, {model.vocab_size})")
            return ids
        msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if sum(len(m["content"].encode()) for m in msgs) > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"messages exceed {MAX_PROMPT_BYTES} bytes of content")
        return model.encode_messages(msgs)

    def _candidates(self, model: str, matched: Optional[dict[str, int]] = None) -> list[Candidate]:
        """Every live replica of ``model`` with its load. Raises Unavailable if none is live."""
        live = self.replicas.for_model(model)
        if not live:
            raise Unavailable(f"no live replica serves model {model!r}")
        ledger, matched = self.replicas.ledger, matched or {}
        return [Candidate(info, load, matched.get(info.replica_id, 0),
                          ledger.inflight[info.replica_id], ledger.settled(info.replica_id))
                for info, load in live]

    def _claim_id(self, tenant: str, client_id: str) -> tuple[str, str]:
        """(the client's id or a new one, the id the worker sees: that one namespaced by
        tenant, so two tenants may both use "req-1"). Raises AlreadyExists for an id live for
        the same tenant on this router; a claimed id is released by :meth:`_generate`."""
        if not client_id:
            client_id = uuid.uuid4().hex
        elif (tenant, client_id) in self._live_ids:
            raise AlreadyExists(f"request_id {client_id!r} is already live for this tenant")
        else:
            self._live_ids.add((tenant, client_id))
        return client_id, f"{tenant}/{client_id}"

    async def _abort(self, context, trace, code, details: str) -> None:
        """End the call with ``code``; a refusal carries gRPC's retry hint."""
        trace.fail(code, details)
        trailers = ()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            trailers = ((RETRY_PUSHBACK_KEY, str(self.retry_pushback_ms)),)
        await context.abort(code, details, trailers)

    async def route(self, model: ServedModel, chain: list[bytes]) -> RouteDecision:
        """Pick a replica for a chain of block hashes. Raises Unavailable if none is live."""
        self._candidates(model.name)  # Unavailable before any lookup
        matched: dict[str, int] = {}
        t0 = time.perf_counter()
        index_used, source = False, ""
        # During an outage skip the lookup (each would wait for a timeout): route by load until
        # the background refresh sees Redis answer again.
        if chain and self.policy.name == "prefix_aware" and self.replicas.index_available:
            source = "mirror" if self.replicas.index.local else "redis"
            try:
                matched = await self.replicas.index.match(chain)
                index_used = True
                self.replicas.mark_index_up()
            except IndexUnavailable as exc:
                self.replicas.mark_index_down(exc)
        redis_s = time.perf_counter() - t0
        candidates = self._candidates(model.name, matched)
        return RouteDecision(self.policy.choose(with_room(candidates), chain), len(chain), redis_s,
                             index_used, source if index_used else "", tuple(candidates))

    # ---- RPCs ------------------------------------------------------------------------------
    async def Generate(self, request: router_pb2.GenerateRequest, context):
        metadata = context.invocation_metadata()
        with self.telemetry.request(metadata, request.WhichOneof("prompt")) as trace:
            async with contextlib.aclosing(self._generate(request, context, metadata, trace)) as out:
                async for msg in out:
                    yield msg

    async def _generate(self, request, context, metadata, trace):
        try:
            tenant = self.auth.tenant(metadata)
            model = self._model(request.model)
            candidates = self._candidates(model.name)
            limit = self.auth.tenant_limit(tenant, fleet_capacity(candidates))
            check_tenant(tenant, self.tenant_inflight[tenant], limit)  # before tokenizing: cheap
            check_room(candidates, model.name)
            if request.adapter:
                raise NotFound(f"adapter {request.adapter!r} is not loaded")
            params = SamplingParams.from_proto(request.sampling).check_vocab(model.vocab_size)
            trace.on_request(model.name, params, tenant)
            with trace.tokenize() as tokenized:
                tokens = self._prompt_tokens(request, model)
                tokenized["tokens"] = len(tokens)
            total = len(tokens) + params.max_tokens
            if total > model.max_context:
                raise OutOfRange(
                    f"prompt ({len(tokens)} tokens) + sampling.max_tokens ({params.max_tokens}) "
                    f"= {total} exceeds the context of {model.max_context} tokens")
            route_start = time.monotonic()
            scope = self.auth.cache_scope(tenant)  # the tenant, or its shared namespace
            chain = block_hash_chain(model.root_hash(scope, request.cache_salt), tokens,
                                     model.block_size)
            decision = await self.route(model, chain)
            trace.routed(route_start, decision, self.policy.name)
            client_id, request_id = self._claim_id(tenant, request.request_id)  # last: released below
        except KvfleetError as exc:
            await self._abort(context, trace, *status_of(exc))
            return
        self.tenant_inflight[tenant] += 1
        try:
            async for msg in self._dispatch(request, context, trace, model, chain, decision,
                                            (client_id, request_id), params, tokens, scope):
                yield msg
        finally:
            self._live_ids.discard((tenant, request.request_id))
            self.tenant_inflight[tenant] -= 1

    async def _dispatch(self, request, context, trace, model, chain, decision, ids,
                        params, tokens, scope):
        """Relay the chosen replica's stream (once more elsewhere if the link failed first).
        ``ids``: (the client's request id, the worker's)."""
        client_id, request_id = ids
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.time() + remaining
        for attempt in (1, 2):
            info = decision.candidate.info
            call = self._worker_call(request, request_id, params, tokens, scope, info, trace,
                                     deadline)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: %d tokens → %s (%s); candidates: %s", request_id,
                          len(tokens), info.replica_id, self.policy.name,
                          "; ".join(c.describe() for c in decision.candidates))
            relayed = False
            dispatched_at = self.replicas.ledger.dispatched(info.replica_id)
            # The client's deadline travels as deadline_unix_s (the worker enforces it); gRPC
            # cancels this handler at the same deadline, which cancels the call below.
            try:
                async for msg in call:
                    relayed = True
                    msg.request_id = client_id  # the worker's carries the tenant
                    if msg.finish_reason:
                        trace.on_final(msg)
                    yield msg
                trace.dispatched(call.trailing_metadata())
                context.set_trailing_metadata(trace.trailers())
                return
            except WorkerCallError as exc:
                if exc.link_failed:
                    self.replicas.mark_unreachable(info)
                    retry = None
                    if not relayed and attempt == 1:  # nothing reached the client: safe to move
                        with contextlib.suppress(KvfleetError):
                            retry = await self.route(model, chain)
                        if retry is not None and retry.candidate.info.replica_id != info.replica_id:
                            trace.dispatch_failed(exc.code, exc.details)
                            decision = retry
                            continue
                await self._abort(context, trace, exc.code, exc.details or "worker stream failed")
            finally:
                self.replicas.ledger.finished(info.replica_id, dispatched_at)
                call.cancel()  # no-op when finished; aborts the worker's call if the client left

    def _worker_call(self, request, request_id: str, params: SamplingParams,
                     tokens: Sequence[int], scope: str, info, trace,
                     deadline_unix_s: Optional[float]) -> LinkCall:
        """The worker request for one dispatch to ``info``, ready to iterate."""
        call = self.replicas.link(info).call(
            trace.start_dispatch(request_id, info.replica_id, info.address))
        worker_req = call.request  # filled in place: no copy of the prompt into the frame
        worker_req.request_id, worker_req.tenant = request_id, scope
        worker_req.cache_salt, worker_req.adapter = request.cache_salt, request.adapter
        worker_req.prompt_token_ids.extend(tokens)
        params.to_proto(worker_req.sampling)
        if deadline_unix_s is not None:
            worker_req.deadline_unix_s = deadline_unix_s
        return call

    async def Tokenize(self, request, context):
        try:
            model = self._model(request.model)
            kind = request.WhichOneof("prompt")
            if kind == "messages":
                ids = model.encode_messages([{"role": m.role, "content": m.content}
                                             for m in request.messages.messages])
            elif kind == "text" and request.text:
                ids = model.encode_text(request.text)
            else:
                raise InvalidArgument("prompt: text or messages is required")
        except KvfleetError as exc:
            await context.abort(*status_of(exc))
            return
        return router_pb2.TokenizeResponse(token_ids=ids, block_size=model.block_size,
                                           num_full_blocks=len(ids) // model.block_size)

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelInfo(name=m.name, max_context=m.max_context, block_size=m.block_size,
                                 identity=m.identity.digest().hex())
            for m in self.models.values()])

    async def ClusterStatus(self, request, context):
        now = time.time()
        out = router_pb2.ClusterStatusResponse(policy=self.policy.name,
                                               index_available=self.replicas.index_available)
        for info, load in self.replicas.replicas.values():
            r = out.replicas.add(replica_id=info.replica_id, address=info.address,
                                 model=info.model, epoch=info.epoch,
                                 tensor_parallel_size=info.tensor_parallel_size,
                                 ranks=[common_pb2.RankStatus(**rank) for rank in info.ranks])
            if load is not None:
                r.running, r.waiting = load.running, load.waiting
                r.num_free_blocks, r.num_total_blocks = load.num_free_blocks, load.num_total_blocks
                r.heartbeat_age_s = max(0.0, now - load.updated_at)
        return out
