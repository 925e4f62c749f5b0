"""The router's LoadAdapter / UnloadAdapter: authorise, then apply on every live replica of
the model concurrently; one result per replica. The replicas report the new servable set with
their next heartbeat (within ``heartbeat_interval_s``), after which requests may name it."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import grpc

from kvfleet.errors import StatusError, Unavailable
from kvfleet.v1 import common_pb2

WORKER_TIMEOUT_S = 60.0  # checking an adapter reads its whole weights file once


async def on_every_replica(core, tenant: str, model: str,
                           call: Callable[..., Awaitable[common_pb2.AdapterReply]]
                           ) -> common_pb2.AdapterReply:
    """Run ``call(stub, timeout=seconds)`` against every live replica of ``model`` (empty =
    the default; ``stub`` a :class:`WorkerStub`).

    Raises:
        PermissionDenied: ``tenant`` is not an adapter admin (key file).
        NotFound: the model is not served. Unavailable: no live replica.
        StatusError: every replica refused with the same status (e.g. INVALID_ARGUMENT for a
            bad adapter, NOT_FOUND unloading one not served): that status and its message.
    """
    core.auth.check_adapter_admin(tenant)
    served = core.model(model)
    live = [info for info, _ in core.replicas.for_model(served.name)]
    if not live:
        raise Unavailable(f"no live replica serves model {served.name!r}")

    async def one(info) -> tuple[common_pb2.ReplicaAdapterResult, grpc.StatusCode | None]:
        try:
            reply = await call(core.replicas.link(info).stub, timeout=WORKER_TIMEOUT_S)
            return common_pb2.ReplicaAdapterResult(replica_id=info.replica_id,
                                                   revision=reply.results[0].revision), None
        except grpc.aio.AioRpcError as exc:
            return common_pb2.ReplicaAdapterResult(
                replica_id=info.replica_id, error=f"{exc.code().name}: {exc.details()}"), exc.code()

    outcomes = await asyncio.gather(*(one(info) for info in live))
    codes = {code for _, code in outcomes}
    if None not in codes and len(codes) == 1:
        first = outcomes[0][0].error.split(": ", 1)[-1]
        raise StatusError(codes.pop(), first)
    return common_pb2.AdapterReply(results=[r for r, _ in outcomes])
