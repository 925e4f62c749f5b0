"""Drive a router (or a worker) with the workload over gRPC, or a router's OpenAI-compatible
HTTP front (:class:`HttpTarget`, a plain httpx client): open-loop Poisson or closed loop.

Every request's client-side timings (monotonic seconds) and its final usage are kept; nothing
is aggregated here (see :mod:`bench.common.report`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

import grpc

from bench.common.workload import Request
from kvfleet.grpc_util import CHANNEL_OPTIONS
from kvfleet.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class Result:
    """One request as the client saw it. Times are ``time.monotonic()`` seconds."""

    request: Request
    sent: float
    first: Optional[float] = None  # first message carrying tokens
    done: Optional[float] = None
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    messages: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def ok(self) -> bool:
        return not self.error and self.done is not None


class Target:
    """A router (``Router.Generate`` with token ids) or a worker (``Worker.Generate``)."""

    def __init__(self, address: str, kind: str = "router", max_tokens: int = 16) -> None:
        self.address, self.kind, self.max_tokens = address, kind, max_tokens
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        if kind == "router":
            self._call = router_pb2_grpc.RouterStub(self.channel).Generate
        else:
            self._call = worker_pb2_grpc.WorkerStub(self.channel).Generate

    def _message(self, req: Request):
        if self.kind == "router":
            m = router_pb2.GenerateRequest()
            m.token_ids.ids.extend(req.token_ids)
        else:
            m = worker_pb2.WorkerGenerateRequest(request_id=uuid.uuid4().hex,
                                                 prompt_token_ids=req.token_ids, tenant="default")
        m.sampling.max_tokens = self.max_tokens
        m.sampling.ignore_eos = True
        return m

    async def send(self, req: Request, timeout_s: float = 600.0) -> Result:
        msg = self._message(req)
        res = Result(req, time.monotonic())
        try:
            async for m in self._call(msg, timeout=timeout_s):
                res.messages += 1
                if res.first is None and m.token_ids:
                    res.first = time.monotonic()
                if m.finish_reason:
                    res.replica = m.replica_id
                    res.prompt_tokens = m.usage.prompt_tokens
                    res.cached_tokens = m.usage.cached_prompt_tokens
            res.done = time.monotonic()
        except grpc.aio.AioRpcError as exc:
            res.error = f"{exc.code().name}: {exc.details()}"
        return res

    async def close(self) -> None:
        await self.channel.close()


class HttpTarget:
    """A router's HTTP front: ``POST /v1/completions`` with the prompt's token ids, streamed
    (SSE). The first token counts at the first chunk with text (completions have no role-only
    chunk); the request's usage comes with ``stream_options.include_usage``."""

    def __init__(self, address: str, max_tokens: int = 16) -> None:
        import httpx

        self.address, self.max_tokens = address, max_tokens
        self.client = httpx.AsyncClient(base_url=f"http://{address}", timeout=600.0,
                                        limits=httpx.Limits(max_connections=256,
                                                            max_keepalive_connections=256))

    async def send(self, req: Request, timeout_s: float = 600.0) -> Result:
        body = {"prompt": list(req.token_ids), "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        res = Result(req, time.monotonic())
        try:
            async with self.client.stream("POST", "/v1/completions", json=body,
                                          timeout=timeout_s) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    res.messages += 1
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = chunk["error"]["message"]
                        return res
                    if res.first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                        res.first = time.monotonic()
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        res.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            res.done = time.monotonic()
        except Exception as exc:  # noqa: BLE001 — any transport failure is this request's error
            res.error = f"{type(exc).__name__}: {exc}"
        return res

    async def close(self) -> None:
        await self.client.aclose()


async def open_loop(target: Target, reqs: Sequence[Request]) -> list[Result]:
    """Send each request at its ``offset_s`` from now; wait for all of them."""
    start = time.monotonic()
    tasks = []
    for r in reqs:
        delay = start + r.offset_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(target.send(r)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(target: Target, reqs: Sequence[Request], concurrency: int,
                      duration_s: float) -> list[Result]:
    """``concurrency`` clients, each sending the next request when its last one ends, for
    ``duration_s`` seconds (requests in flight at the end are awaited and kept)."""
    it = iter(reqs)
    stop_at = time.monotonic() + duration_s
    out: list[Result] = []

    async def client() -> None:
        while time.monotonic() < stop_at:
            try:
                r = next(it)
            except StopIteration:
                return
            out.append(await target.send(r))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out
