"""One authorisation choke point for a gRPC server: a server interceptor that checks every call
before its handler runs, so that a new RPC cannot forget to.

``authorize(method, context)`` returns the caller's identity (the router: the tenant of the
API key; the worker: the peer's certificate name) or raises a
:class:`~kvfleet.errors.KvfleetError`, which ends the call with its status before the handler
is entered. The handler reads the identity with :func:`caller` (it runs in its own task, so the
value is the call's own). Only the health service and server reflection are open (a load
balancer's probe, ``grpcurl``'s schema).
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Awaitable, Callable, Mapping, Optional, Union

import grpc

from kvfleet.errors import KvfleetError, PermissionDenied, status_of

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("kvfleet_caller")

Authorize = Callable[[str, grpc.aio.ServicerContext], Union[str, Awaitable[str]]]


def caller() -> str:
    """The identity :class:`AuthInterceptor` authorised for the current call.

    Raises LookupError outside an authorised call (fail closed: a handler served without the
    interceptor has no caller)."""
    return _CALLER.get()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Runs ``authorize`` on every call except :data:`OPEN_PREFIXES`; see the module docstring."""

    def __init__(self, authorize: Authorize) -> None:
        self._authorize = authorize

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                make = getattr(grpc, f"{kind}_rpc_method_handler")
                return make(self._guarded(method, behavior),
                            request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    async def _admit(self, method: str, context) -> bool:
        try:
            identity = self._authorize(method, context)
            if inspect.isawaitable(identity):
                identity = await identity
        except KvfleetError as exc:
            await context.abort(*status_of(exc))
            return False
        _CALLER.set(identity)
        return True

    def _guarded(self, method: str, behavior):
        if inspect.isasyncgenfunction(behavior):
            async def stream(request, context):
                if await self._admit(method, context):
                    async for item in behavior(request, context):
                        yield item
            return stream

        async def call(request, context):
            if await self._admit(method, context):
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
        return call


def internal_authorizer(mutual_tls: bool, peer_name: str,
                        limited: Optional[Mapping[str, frozenset[str]]] = None) -> Authorize:
    """A worker's check: with internal mutual TLS, the caller's certificate must name
    ``peer_name`` (the router's: any method), or a name in ``limited`` for one of the methods
    listed for it (a replica's: ``ExportBlocks``, a peer pull); without mutual TLS there is no
    identity to check (the port's exposure is the deployment's to limit) and every call is
    ``""``.

    The returned function raises PermissionDenied for any other certificate or method."""
    limited = dict(limited or {})

    def authorize(method: str, context) -> str:
        if not mutual_tls:
            return ""
        names = (context.auth_context() or {}).get("x509_common_name", ())
        if peer_name.encode() in names:
            return peer_name
        for name, methods in limited.items():
            if name.encode() in names and method in methods:
                return name
        raise PermissionDenied(f"{method}: the caller's certificate is not {peer_name!r}"
                               + "".join(f" (nor {n!r}, allowed {sorted(m)})"
                                         for n, m in limited.items()))

    return authorize
