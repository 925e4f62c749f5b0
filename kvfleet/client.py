"""A small Python client for a kvfleet router (sync and asyncio), yielding tokens as they arrive.

    from kvfleet.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text, end="", flush=True)

Errors surface as ``grpc.RpcError`` with the server's status code and message.

Pass ``stats=RequestStats()`` to ``stream`` to get the client-observed TTFT next to the
worker's timing, the router's network time and the trace id; pass a
:class:`~kvfleet.telemetry.Telemetry` to ``Client(…, telemetry=…)`` to open a ``client.Generate``
span per request (otherwise a span current in the caller's context is propagated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Generator, Optional, Sequence

import grpc

from kvfleet.telemetry.client_spans import ClientTelemetry, RequestStats
from kvfleet.telemetry.provider import Telemetry
from kvfleet.tls import client_credentials
from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc

_FINISH = {common_pb2.STOP: "stop", common_pb2.LENGTH: "length"}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                    "speculative")


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the tokens one engine step produced for sample ``index``."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: Optional[str]  # "stop" / "length" on the sample's last chunk, else None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    replica_id: str = ""
    timing: dict = field(default_factory=dict)  # worker-measured seconds: queue/prefill/decode/ttft/replica
    received_s: float = 0.0  # client monotonic clock when this chunk arrived

    @classmethod
    def from_proto(cls, m: common_pb2.GenerateResponse, received_s: float) -> "Chunk":
        done = m.finish_reason in _FINISH
        return cls(
            index=m.index, token_ids=tuple(m.token_ids), text=m.text,
            finish_reason=_FINISH.get(m.finish_reason),
            prompt_tokens=m.usage.prompt_tokens if done else 0,
            cached_prompt_tokens=m.usage.cached_prompt_tokens if done else 0,
            completion_tokens=m.usage.completion_tokens if done else 0,
            replica_id=m.replica_id,
            timing={k: getattr(m.timing, k) for k in ("queue_s", "prefill_s", "decode_s", "ttft_s",
                                                      "replica_s")}
            if done else {},
            received_s=received_s)


def build_request(prompt: Optional[str] = None, *, messages: Optional[Sequence[dict]] = None,
                  token_ids: Optional[Sequence[int]] = None, model: str = "",
                  adapter: str = "", cache_salt: str = "", request_id: str = "",
                  stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), **sampling) -> router_pb2.GenerateRequest:
    """Build a GenerateRequest; exactly one of ``prompt``, ``messages``, ``token_ids``
    (``adapter``: a LoRA adapter the replicas serve, by name; empty = the base model).

    ``sampling`` keys: max_tokens, temperature, top_p, top_k, seed, n, ignore_eos,
    presence_penalty, frequency_penalty, repetition_penalty, logprobs, speculative (False opts
    out of speculative decoding) (None = server default).

    Raises:
        ValueError: zero or several prompt forms, an unknown sampling key, or a value its
            field cannot hold (the message names the field).
    """
    forms = [x is not None for x in (prompt, messages, token_ids)]
    if sum(forms) != 1:
        raise ValueError("give exactly one of prompt, messages, token_ids")
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
    req = router_pb2.GenerateRequest(model=model, adapter=adapter, cache_salt=cache_salt,
                                     request_id=request_id)
    if prompt is not None:
        req.text = prompt
    elif messages is not None:
        req.messages.messages.extend(
            common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        req.token_ids.ids.extend(token_ids)
    for k, v in sampling.items():
        if v is not None:
            try:
                setattr(req.sampling, k, v)
            except (ValueError, TypeError) as exc:  # e.g. a negative seed for a uint64 field
                raise ValueError(f"sampling.{k}: {v!r} does not fit the field ({exc})") from None
    req.sampling.stop.extend(stop)
    try:
        req.sampling.stop_token_ids.extend(stop_token_ids)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"sampling.stop_token_ids: {exc}") from None
    return req


def _metadata(api_key: Optional[str]):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _credentials(tls_ca: Optional[str], credentials: Optional[grpc.ChannelCredentials]):
    """The channel's TLS credentials: given ones, else trust ``tls_ca`` (PEM file); None =
    plaintext."""
    return credentials or (client_credentials(tls_ca) if tls_ca else None)


class Client:
    """Blocking client. ``timeout`` (seconds) becomes the request's gRPC deadline.

    TLS: ``tls_ca`` (a PEM file with the CA that signed the router's certificate) or
    ``credentials`` (any :class:`grpc.ChannelCredentials`); neither = plaintext.
    """

    def __init__(self, address: str = "127.0.0.1:50051", api_key: Optional[str] = None,
                 telemetry: Optional[Telemetry] = None, tls_ca: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None) -> None:
        creds = _credentials(tls_ca, credentials)
        self._channel = (grpc.secure_channel(address, creds) if creds
                         else grpc.insecure_channel(address))
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = _metadata(api_key)
        self._telemetry = ClientTelemetry(telemetry)  # client.Generate spans, client TTFT

    def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None,
               stats: Optional[RequestStats] = None, **kwargs) -> Generator[Chunk, None, None]:
        """Yield chunks as they arrive (see :func:`build_request` for arguments).

        ``stats``, when given, is filled in: client-observed TTFT, the worker's timing, the
        router's network time and the trace id.
        """
        request = build_request(prompt, **kwargs)
        trace = self._telemetry.start(request, stats)
        call = self._stub.Generate(request, timeout=timeout,
                                   metadata=trace.metadata(self._metadata))
        try:
            for m in call:
                chunk = Chunk.from_proto(m, time.monotonic())
                trace.on_chunk(chunk)
                yield chunk
            trace.on_trailers(call.trailing_metadata())
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            trace.end()
            call.cancel()  # stop the server-side work if the caller stops early

    def generate(self, prompt: Optional[str] = None, **kwargs) -> str:
        """The whole completion text of sample 0."""
        return "".join(c.text for c in self.stream(prompt, **kwargs) if c.index == 0)

    def list_models(self) -> router_pb2.ListModelsResponse:
        return self._stub.ListModels(router_pb2.ListModelsRequest(), metadata=self._metadata)

    def cluster_status(self) -> router_pb2.ClusterStatusResponse:
        return self._stub.ClusterStatus(router_pb2.ClusterStatusRequest(), metadata=self._metadata)

    def load_adapter(self, name: str, path: str, model: str = "") -> common_pb2.AdapterReply:
        """Serve the PEFT adapter directory ``path`` (as the replicas' hosts see it) as
        ``name`` on every live replica; one result per replica. Raises grpc.RpcError."""
        return self._stub.LoadAdapter(common_pb2.LoadAdapterRequest(model=model, name=name, path=path),
                                      metadata=self._metadata)

    def unload_adapter(self, name: str, model: str = "") -> common_pb2.AdapterReply:
        """Stop serving adapter ``name`` on every live replica. Raises grpc.RpcError."""
        return self._stub.UnloadAdapter(common_pb2.UnloadAdapterRequest(model=model, name=name),
                                        metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same arguments as :class:`Client`."""

    def __init__(self, address: str = "127.0.0.1:50051", api_key: Optional[str] = None,
                 telemetry: Optional[Telemetry] = None, tls_ca: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None) -> None:
        creds = _credentials(tls_ca, credentials)
        self._channel = (grpc.aio.secure_channel(address, creds) if creds
                         else grpc.aio.insecure_channel(address))
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = _metadata(api_key)
        self._telemetry = ClientTelemetry(telemetry)

    async def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None,
                     stats: Optional[RequestStats] = None, **kwargs) -> AsyncIterator[Chunk]:
        request = build_request(prompt, **kwargs)
        trace = self._telemetry.start(request, stats)
        call = self._stub.Generate(request, timeout=timeout,
                                   metadata=trace.metadata(self._metadata))
        try:
            async for m in call:
                chunk = Chunk.from_proto(m, time.monotonic())
                trace.on_chunk(chunk)
                yield chunk
            trace.on_trailers(await call.trailing_metadata())
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            trace.end()
            call.cancel()

    async def generate(self, prompt: Optional[str] = None, **kwargs) -> str:
        return "".join([c.text async for c in self.stream(prompt, **kwargs) if c.index == 0])

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
