"""The Router gRPC service: the gRPC edge of the request path in ``router/core.py``."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import grpc

from kvfleet import priority
from kvfleet.constraint import Constraint
from kvfleet.errors import InvalidArgument, KvfleetError, status_of
from kvfleet.grpc_auth import caller
from kvfleet.index_keys import REDIS_DOWN_ERRORS, redis_host
from kvfleet.router.adapter_admin import on_every_replica
from kvfleet.router.adapter_routing import served_adapters
from kvfleet.router.capacity import RETRY_PUSHBACK_KEY
from kvfleet.router.core import GenerateInput, Prompt, RouterCore
from kvfleet.router.presence import RouterPresence
from kvfleet.sampling_params import SamplingParams
from kvfleet.stream_limits import SlowReader, write_within
from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


def prompt_from_proto(request: router_pb2.GenerateRequest) -> Prompt:
    """The prompt of a ``GenerateRequest`` (no copy of token ids or messages beyond one list)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return Prompt("text", text=request.text)
    if kind == "token_ids":
        return Prompt("token_ids", token_ids=request.token_ids.ids)
    if kind == "messages":
        return Prompt("messages", messages=[{"role": m.role, "content": m.content}
                                            for m in request.messages.messages])
    return Prompt("")


def priority_from_proto(request: router_pb2.GenerateRequest) -> Optional[int]:
    """The request's own priority (None: unset). Raises InvalidArgument naming the field."""
    kind = request.WhichOneof("priority")
    if kind is None:
        return None
    return priority.parse(getattr(request, kind), kind)


_RANK_FIELDS = frozenset(common_pb2.RankStatus.DESCRIPTOR.fields_by_name)


def rank_status(rank: dict) -> common_pb2.RankStatus:
    """A registry rank dict as ``RankStatus``; fields this router does not know (a newer
    worker's) are left out rather than failing the whole status."""
    return common_pb2.RankStatus(**{k: v for k, v in rank.items() if k in _RANK_FIELDS})


class RouterService(router_pb2_grpc.RouterServicer):
    """The gRPC edge of :class:`~kvfleet.router.core.RouterCore`: proto in, proto out. A
    client that does not read its stream for ``core.stream_limits.stall_s`` is cancelled."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.presence: Optional[RouterPresence] = None  # the cluster's routers, for ClusterStatus

    def authorize(self, method: str, context) -> str:
        """Every call's check (the server's :class:`~kvfleet.grpc_auth.AuthInterceptor`):
        the tenant of its API key; ``ClusterStatus`` also needs a cluster admin.

        Raises Unauthenticated, or PermissionDenied for a non-admin's ``ClusterStatus``."""
        tenant = self.core.authenticate(context.invocation_metadata())
        if method.endswith("/ClusterStatus"):
            self.core.auth.check_admin(tenant)
        return tenant

    async def Generate(self, request: router_pb2.GenerateRequest, context):
        metadata = context.invocation_metadata()
        with self.core.telemetry.request(metadata, request.WhichOneof("prompt")) as trace:
            try:
                tenant = caller()  # authenticated by the server's AuthInterceptor
                remaining = context.time_remaining()
                req = GenerateInput(
                    prompt=prompt_from_proto(request),
                    sampling=SamplingParams.from_proto(request.sampling), model=request.model,
                    adapter=request.adapter, cache_salt=request.cache_salt,
                    request_id=request.request_id,
                    deadline_unix_s=None if remaining is None else time.time() + remaining,
                    constraint=Constraint.from_proto(request),
                    priority=priority.within_key(priority_from_proto(request),
                                                 self.core.auth.key_class(metadata),
                                                 request.WhichOneof("priority") or "priority"))
                # gRPC cancels this handler at the client's deadline, which cancels the relay.
                async with contextlib.aclosing(self.core.generate(req, tenant, trace)) as out:
                    async for msg in out:
                        await write_within(context.write(msg), self.core.stream_limits,
                                           "Generate")
            except KvfleetError as exc:
                code, details = status_of(exc)
                details = details or "worker stream failed"
                trace.fail(code, details)
                trailers: tuple[tuple[str, str], ...] = ()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not isinstance(exc, SlowReader):
                    # a refusal carries the retry hint
                    trailers = ((RETRY_PUSHBACK_KEY, str(self.core.retry_pushback_ms)),)
                await context.abort(code, details, trailers)
                return
            context.set_trailing_metadata(trace.trailers())

    async def Tokenize(self, request, context):
        try:
            model = self.core.model(request.model)
            if request.WhichOneof("prompt") not in ("text", "messages") or (
                    request.WhichOneof("prompt") == "text" and not request.text):
                raise InvalidArgument("prompt: text or messages is required", field="prompt")
            # The Generate path's bounds, off the event loop.
            ids = await self.core.prompt_tokens(prompt_from_proto(request), model)
        except KvfleetError as exc:
            await context.abort(*status_of(exc))
            return
        return router_pb2.TokenizeResponse(token_ids=ids, block_size=model.block_size,
                                           num_full_blocks=len(ids) // model.block_size)

    async def ListModels(self, request, context):
        tenant, auth = caller(), self.core.auth
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelInfo(name=m.name, max_context=m.max_context, block_size=m.block_size,
                                 identity=m.identity.digest().hex(),
                                 adapters=[router_pb2.AdapterInfo(**a) for a in served_adapters(
                                     [info for info, _ in self.core.replicas.for_model(m.name)])
                                     if auth.may_use_adapter(tenant, a["name"])])
            for m in self.core.models.values()])

    async def LoadAdapter(self, request, context):
        return await self._adapter_op(context, request.model, lambda stub, timeout: stub.LoadAdapter(
            common_pb2.LoadAdapterRequest(name=request.name, path=request.path), timeout=timeout))

    async def UnloadAdapter(self, request, context):
        return await self._adapter_op(context, request.model, lambda stub, timeout: stub.UnloadAdapter(
            common_pb2.UnloadAdapterRequest(name=request.name), timeout=timeout))

    async def _adapter_op(self, context, model: str, call):
        try:
            return await on_every_replica(self.core, caller(), model, call)
        except KvfleetError as exc:
            await context.abort(*status_of(exc))

    async def ClusterStatus(self, request, context):
        replicas = self.core.replicas
        # Read the registry now, not at the periodic read: a replica that registered a moment
        # ago (the launcher's "ready" waits for that) is listed.
        await replicas.refresh()
        now = time.time()
        out = router_pb2.ClusterStatusResponse(policy=self.core.policy.name,
                                               index_available=replicas.index_available)
        for info, load in replicas.replicas.values():
            r = out.replicas.add(replica_id=info.replica_id, address=info.address,
                                 model=info.model, epoch=info.epoch,
                                 tensor_parallel_size=info.tensor_parallel_size,
                                 ranks=[rank_status(rank) for rank in info.ranks])
            r.lifecycle.CopyFrom(router_pb2.ReplicaLifecycle(
                state=info.state, prefix_hit_rate=info.prefix_hit_rate,
                serve_replica=info.serve_replica, metrics_address=info.metrics_address))
            if load is not None:
                r.running, r.waiting = load.running, load.waiting
                r.num_free_blocks, r.num_total_blocks = load.num_free_blocks, load.num_total_blocks
                r.heartbeat_age_s = max(0.0, now - load.updated_at)
        if self.presence is not None:
            out.redis = redis_host(self.presence.redis_url)
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                for found in await self.presence.routers():
                    out.routers.add(router_id=found["router_id"], address=found["address"],
                                    http_address=found.get("http_address", ""),
                                    policy=found.get("policy", ""), pid=int(found.get("pid", 0)),
                                    started_at_unix_s=float(found.get("started_at", 0.0)))
        return out
