"""The router's OpenAI-compatible HTTP front: Starlette on uvicorn, in the router's event loop.

HTTPS when the router has ``--tls-cert/--tls-key`` (the gRPC port's certificate), else HTTP.
``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent events,
ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Every generation goes through
:meth:`RouterCore.generate`, the path the gRPC handler takes (same auth, validation, tokenizer,
routing, worker links, traces): no second loop, no loopback gRPC hop. Errors are OpenAI error
bodies with the HTTP status of their gRPC code (``router/openai_response.py``); once an SSE
stream has started a failure is one ``data: {"error": …}`` event and no ``[DONE]``. A client
that disconnects cancels its request on the worker (its KV blocks are freed); so does one
that stops reading (``RouterCore.stream_limits``: a write held ``stall_s`` by TCP flow
control closes the connection, a backlog past ``max_unread`` cancels the worker call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from dataclasses import replace
from typing import AsyncGenerator, Optional

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvfleet import priority
from kvfleet.constraint import MAX_SCHEMA_DEPTH, check_json_depth, too_deep
from kvfleet.errors import InvalidArgument, KvfleetError, PromptTooLarge, status_of
from kvfleet.grpc_util import MAX_MESSAGE_BYTES
from kvfleet.router.adapter_routing import served_adapters
from kvfleet.router.core import RouterCore
from kvfleet.router.http_streams import ClientDisconnected, merge, until_disconnected
from kvfleet.router.openai_request import (
    OpenAIRequest,
    openai_param,
    parse_chat,
    parse_completion,
)
from kvfleet.router.openai_response import ResponseBuilder, error_response
from kvfleet.stream_limits import SlowReader, StreamLimits, write_within
from kvfleet.v1 import common_pb2

log = logging.getLogger(__name__)

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
REQUEST_ID_HEADER = "x-request-id"       # optional; the router assigns one when absent
TIMEOUT_HEADER = "x-request-timeout"     # optional deadline, seconds (gRPC: the call's timeout)
CLIENT_CLOSED = 499                       # nginx's status for a request its client abandoned
# Open connections (and their requests) the front serves at once; past it uvicorn answers
# 503 at once instead of holding a connection, a task and its buffers for each.
DEFAULT_MAX_CONNECTIONS = 4096
# A body's JSON nesting levels: room for a schema at its own bound (then refused naming its
# field) inside the body's wrapping, and far below what the recursive readers after it
# (json.dumps, the chat template) can take.
MAX_BODY_DEPTH = 2 * MAX_SCHEMA_DEPTH


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however it ends (a client gone
    mid-send included), so the request's worker call is cancelled at once, not at GC; a
    send the client's flow control holds past ``limits.stall_s`` ends the response (uvicorn
    then closes the connection: the response is incomplete)."""

    def __init__(self, content: AsyncGenerator[bytes, None], limits: StreamLimits, **kw) -> None:
        super().__init__(content, **kw)
        self.limits = limits
        self._content = content

    async def stream_response(self, send) -> None:
        async def bounded(message) -> None:
            await write_within(send(message), self.limits, "SSE stream")

        try:
            await super().stream_response(bounded)
        except SlowReader as exc:
            log.info("%s", exc)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()


OPEN_PATHS = frozenset({"/health"})  # a load balancer's readiness probe carries no key
TENANT_KEY = "kvfleet_tenant"  # the ASGI scope entry the endpoints read the tenant from


class _Authenticate:
    """The HTTP front's one authentication point (ASGI middleware, so streaming responses
    pass through untouched): every request but :data:`OPEN_PATHS` gets its tenant in
    ``scope[TENANT_KEY]`` or an OpenAI error body (401)."""

    def __init__(self, app, core: RouterCore) -> None:
        self.app, self.core = app, core

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = [(k.decode("latin-1").lower(), v.decode("latin-1"))
                       for k, v in scope["headers"]]
            try:
                scope[TENANT_KEY] = self.core.authenticate(headers)
            except KvfleetError as exc:
                code, message = status_of(exc)
                status, body, extra = error_response(code, message or code.name, None, exc)
                await JSONResponse(body, status_code=status, headers=extra)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _with_key_priority(oreq: OpenAIRequest, key_class: Optional[int]) -> OpenAIRequest:
    """``oreq`` with each input's priority bounded by its API key's class (the default of
    inputs whose body set none). Raises PermissionDenied for one above the key's class."""
    return replace(oreq, inputs=tuple(replace(i, priority=priority.within_key(i.priority, key_class))
                                      for i in oreq.inputs))


def _tenant(request: Request) -> str:
    """The tenant :class:`_Authenticate` set. Raises KeyError without it (fail closed)."""
    return request.scope[TENANT_KEY]


async def _route_error(request: Request, exc: Exception) -> Response:
    """An unknown path (404) or method (405) as an OpenAI error body, like every other error:
    OpenAI clients parse ``error.message`` and would otherwise show Starlette's plain text."""
    status = getattr(exc, "status_code", 404)
    if status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        kind, code = "invalid_request_error", "method_not_allowed"
    else:
        message = f"no route {request.method} {request.url.path}"
        kind, code = "not_found_error", "not_found"
    headers = dict(getattr(exc, "headers", None) or {})  # 405's Allow
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers=headers)


class HttpFront:
    """The HTTP listener of one router process, over the router's :class:`RouterCore`."""

    def __init__(self, core: RouterCore, host: str = "127.0.0.1", port: int = 8000,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 shutdown_grace_s: float = 2.0, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None) -> None:
        """``max_connections``: connections served at once (the next one gets 503);
        ``shutdown_grace_s``: how long :meth:`stop` lets open responses run on;
        ``tls_cert``/``tls_key``: PEM files, to serve HTTPS (the gRPC port's certificate).

        Raises ValueError for ``max_connections`` < 1, a negative grace or only one of the
        TLS files."""
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together")
        self.tls_cert, self.tls_key = tls_cert, tls_key
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {shutdown_grace_s}")
        self.shutdown_grace_s = shutdown_grace_s
        self.core = core
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.address: Optional[str] = None
        self.app = Starlette(routes=[
            Route(CHAT_ROUTE, self.chat, methods=["POST"]),
            Route(COMPLETIONS_ROUTE, self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], middleware=[Middleware(_Authenticate, core=core)],
            exception_handlers={404: _route_error, 405: _route_error})
        self._server: Optional[uvicorn.Server] = None
        self._sock: Optional[socket.socket] = None
        self._ticker: Optional[asyncio.Task] = None

    # ---- lifecycle (on the caller's running loop) -----------------------------------------
    async def start(self) -> str:
        """Listen; returns ``host:port``. Raises OSError if the port is taken."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says
        # TCP (accepted ones inherit it); with proto 0, Nagle held an SSE stream's first chunk
        # behind its headers for the client's delayed ACK (docs/http_api.md).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{self.port} (HTTP): {exc}") from exc
        self._sock = sock
        # lifespan off, no logging config, no signal handlers: the router process owns those.
        # uvicorn counts the connection asking against its limit (L served L - 1): + 1.
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                # typed int; uvicorn passes it to asyncio.wait_for: a float works
                                timeout_graceful_shutdown=self.shutdown_grace_s,  # type: ignore[arg-type]
                                limit_concurrency=self.max_connections + 1,
                                ssl_certfile=self.tls_cert, ssl_keyfile=self.tls_key)
        try:
            config.load()  # reads the TLS files
        except (OSError, ValueError) as exc:
            sock.close()
            raise OSError(f"HTTP front: cannot load --tls-cert/--tls-key: {exc}") from exc
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._server = server
        self._ticker = asyncio.create_task(server.main_loop())  # Date header, exit flag
        port = sock.getsockname()[1]
        self.address = f"{self.host}:{port}"
        return self.address

    async def stop(self, grace_s: Optional[float] = None) -> None:
        """Stop listening, let open responses run on for ``grace_s`` seconds (default: the
        front's ``shutdown_grace_s``), then cut the rest."""
        if self._server is None:
            return
        if grace_s is not None:
            self._server.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]
        self._server.should_exit = True
        assert self._ticker is not None and self._sock is not None  # set with _server
        await self._ticker
        await self._server.shutdown(sockets=[self._sock])
        self._sock.close()
        self._server = self._ticker = self._sock = None

    # ---- endpoints ------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT_ROUTE, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS_ROUTE, parse_completion)

    async def models(self, request: Request) -> Response:
        tenant, auth = _tenant(request), self.core.auth
        data = []
        for m in self.core.models.values():
            data.append({"id": m.name, "object": "model", "created": 0, "owned_by": "kvfleet",
                         "max_model_len": m.max_context})
            live = [info for info, _ in self.core.replicas.for_model(m.name)]
            data += [{"id": a["name"], "object": "model", "created": 0, "owned_by": "kvfleet",
                      "parent": m.name, "max_model_len": m.max_context}
                     for a in served_adapters(live)
                     if a["name"] not in self.core.models and auth.may_use_adapter(tenant, a["name"])]
        return JSONResponse({"object": "list", "data": data})

    def _adapter_as_model(self, oreq: OpenAIRequest) -> tuple[OpenAIRequest, str]:
        """OpenAI clients name a LoRA adapter as the ``model`` (as vLLM serves them): a name
        that is no served model but an adapter of the default model's replicas becomes that
        adapter. Returns the request and the name responses echo ("" = the model's)."""
        name = oreq.inputs[0].model
        if not name or name in self.core.models:
            return oreq, ""
        live = [info for info, _ in self.core.replicas.for_model(self.core.default_model)]
        if not any(info.adapter_revision(name) is not None for info in live):
            return oreq, ""  # core.model() answers NOT_FOUND for it
        inputs = tuple(replace(i, model="", adapter=name) for i in oreq.inputs)
        return replace(oreq, inputs=inputs), name

    async def health(self, request: Request) -> Response:
        """200 while some replica is live (a load balancer's readiness), else 503."""
        live = sum(len(self.core.replicas.for_model(name)) for name in self.core.models)
        return JSONResponse({"status": "ok" if live else "no live replica", "replicas": live},
                            status_code=200 if live else 503)

    # ---- the generation path ----------------------------------------------------------------
    async def _generate(self, request: Request, route: str, parse) -> Response:
        headers = request.headers.items()
        try:
            tenant = _tenant(request)
            rid, oreq = self._with_ids(parse(await self._json(request)), request)
            oreq = _with_key_priority(oreq, self.core.auth.key_class(headers))
            max_prompts = self.core.prompt_limits.max_prompts
            if len(oreq.inputs) > max_prompts:
                raise PromptTooLarge(f"prompt: {len(oreq.inputs)} prompts exceed the limit of "
                                     f"{max_prompts} per request (--max-prompts-per-request)",
                                     field="prompt")
            oreq, shown = self._adapter_as_model(oreq)
            model = self.core.model(oreq.inputs[0].model).name
        except KvfleetError as exc:
            with self.core.telemetry.http_request(headers, route, parse is parse_chat) as trace:
                trace.fail(*status_of(exc))
            return self._error(exc)
        tokenizer = self.core.models[model].tokenizer
        builder = ResponseBuilder(oreq.chat, rid, shown or model, oreq.n, oreq.logprobs,
                                  lambda t: tokenizer.decode([t], skip_special_tokens=False),
                                  oreq.tools)
        events = merge([self._one(p, inp, tenant, headers, route, oreq, builder)
                        for p, inp in enumerate(oreq.inputs)])
        try:
            # Errors until the first token are plain HTTP errors; a client gone meanwhile
            # cancels the request.
            first = await until_disconnected(request.receive, events.__anext__())
            if oreq.stream:
                return _SSEResponse(self._sse(builder, first, events, oreq),
                                    self.core.stream_limits, media_type="text/event-stream",
                                    headers={REQUEST_ID_HEADER: rid})
            builder.add(*first)
            await until_disconnected(request.receive, self._fold(builder, events))
            return JSONResponse(builder.body(), headers={REQUEST_ID_HEADER: rid})
        except KvfleetError as exc:
            await events.aclose()
            return self._error(exc, oreq)
        except ClientDisconnected:
            await events.aclose()
            return Response(status_code=CLIENT_CLOSED)

    async def _one(self, prompt: int, inp, tenant: str, headers, route: str,
                   oreq: OpenAIRequest, builder: ResponseBuilder
                   ) -> AsyncGenerator[tuple[int, common_pb2.GenerateResponse], None]:
        """One prompt's messages as ``(prompt index, message)``, under its own server span;
        ``builder`` learns the prompt's token count before its first message."""
        with self.core.telemetry.http_request(headers, route, oreq.chat, oreq.user) as trace:
            started = False  # after the first message the response status is 200 whatever follows
            try:
                async with contextlib.aclosing(self.core.generate(inp, tenant, trace)) as out:
                    async for msg in out:
                        if not started:
                            builder.prompt_started(prompt, trace.prompt_tokens)
                        started = True
                        yield prompt, msg
                trace.http_status(200)
            except KvfleetError as exc:
                trace.fail(*status_of(exc))
                trace.http_status(200 if started else error_response(*status_of(exc), None, exc)[0])
                raise

    @staticmethod
    async def _fold(builder: ResponseBuilder, events) -> None:
        async for prompt, msg in events:
            builder.add(prompt, msg)

    async def _sse(self, builder: ResponseBuilder, first: tuple[int, common_pb2.GenerateResponse],
                   events: AsyncGenerator[tuple[int, common_pb2.GenerateResponse], None],
                   oreq: OpenAIRequest) -> AsyncGenerator[bytes, None]:
        try:
            for role in builder.role_chunks(len(oreq.inputs)):
                yield _sse(role)
            prompt, msg = first
            chunk = builder.chunk(prompt, msg, oreq.include_usage, oreq.continuous_usage)
            if chunk is not None:  # None: a tool-mode choice holds its text until it ends
                yield _sse(chunk)
            async for prompt, msg in events:
                if (chunk := builder.chunk(prompt, msg, oreq.include_usage,
                                           oreq.continuous_usage)) is not None:
                    yield _sse(chunk)
            if oreq.include_usage:
                yield _sse(builder.usage_chunk())
            yield b"data: [DONE]\n\n"
        except KvfleetError as exc:  # the stream has started: an error event, no [DONE]
            yield _sse(error_response(*status_of(exc), oreq.param(exc.field), exc)[1])
        finally:
            await events.aclose()  # a client gone: Starlette cancels us, which lands here

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    async def _json(request: Request):
        """The body as JSON, read up to the gRPC port's message limit.

        Raises:
            PromptTooLarge: the body exceeds ``MAX_MESSAGE_BYTES`` (HTTP 413).
            InvalidArgument: the body is not JSON, or nests deeper than ``MAX_BODY_DEPTH``.
        """
        try:
            size = int(request.headers.get("content-length") or 0)
        except ValueError:
            size = 0  # uvicorn refuses a malformed length first; count what arrives instead
        chunks, total = [], 0
        if size <= MAX_MESSAGE_BYTES:
            async for chunk in request.stream():
                total += len(chunk)
                if total > MAX_MESSAGE_BYTES:
                    break
                chunks.append(chunk)
        if max(size, total) > MAX_MESSAGE_BYTES:
            raise PromptTooLarge(f"request body exceeds {MAX_MESSAGE_BYTES} bytes", field="body")
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError:
            raise too_deep("body", MAX_BODY_DEPTH) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"the request body is not valid JSON: {exc}",
                                  field="body") from None
        check_json_depth(body, MAX_BODY_DEPTH, "body")  # what reads it later recurses
        return body

    @staticmethod
    def _with_ids(oreq: OpenAIRequest, request: Request) -> tuple[str, OpenAIRequest]:
        """``(request id, oreq with ids and deadline)``: the id is ``x-request-id`` or a new
        one (``<id>-<p>`` per prompt of an array), the deadline ``x-request-timeout`` seconds
        from now. Raises InvalidArgument for a bad timeout."""
        rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        deadline = None
        timeout = request.headers.get(TIMEOUT_HEADER)
        if timeout is not None:
            try:
                seconds = float(timeout)
            except ValueError:
                seconds = float("nan")
            if not 0 < seconds < float("inf"):
                raise InvalidArgument(f"{TIMEOUT_HEADER} must be a number of seconds > 0, "
                                      f"got {timeout!r}", field=TIMEOUT_HEADER)
            deadline = time.time() + seconds
        many = len(oreq.inputs) > 1
        return rid, replace(oreq, inputs=tuple(
            replace(inp, request_id=f"{rid}-{p}" if many else rid, deadline_unix_s=deadline)
            for p, inp in enumerate(oreq.inputs)))

    @staticmethod
    def _error(exc: KvfleetError, oreq: Optional[OpenAIRequest] = None) -> Response:
        code, message = status_of(exc)
        param = oreq.param(exc.field) if oreq is not None else openai_param(exc.field)
        c = oreq.constraint if oreq is not None else None
        if c is not None and code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(c.kind):
            # the worker's compile refusal names the gRPC field: name the request's instead
            message, param = c.field + message[len(c.kind):], c.field
        status, body, headers = error_response(code, message or code.name, param, exc)
        return JSONResponse(body, status_code=status, headers=headers)
