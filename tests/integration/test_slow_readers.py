"""Slow and vanished readers: a client that opens a very long stream and never reads is
cancelled past the bounds (messages buffered, seconds a write waits), its KV blocks are freed
and a concurrent stream completes. The client's HTTP/2 receive window is kept small and BDP
probing (which grows it) off, so back-pressure reaches the server after a few dozen messages
instead of after megabytes."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc

from kvfleet.stream_limits import StreamLimits
from kvfleet.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvfleet.worker.executor.cost_model import CostModel
from tests.integration.routing_fleet import prompt
from tests.integration.test_worker_stream import idle

LONG = 4000  # tokens the never-read stream asks for (ignore_eos): far past every bound
LIMITS = StreamLimits(max_unread=32, stall_s=1.0)
STEP = CostModel(0.001, 0.0, 0.0, "test: 1 ms per step")
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def _replica(fleet: Fleet):
    return await fleet.add_replica("rep-a", num_blocks=600, cost_model=STEP,
                                   stream_limits=LIMITS)


def _router_request(max_tokens: int, seed: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt(seed, 20))
    req.sampling.max_tokens, req.sampling.ignore_eos = max_tokens, True
    return req


async def _drain(call) -> tuple[int, str, str]:
    """(tokens read, final status name, details) of a streaming call, read to its end."""
    tokens = 0
    try:
        async for msg in call:
            tokens += len(msg.token_ids)
    except grpc.aio.AioRpcError as exc:
        return tokens, exc.code().name, exc.details()
    return tokens, "OK", ""


async def _until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


async def _assert_freed(server) -> None:
    """The engine aborted the unread stream (blocks free at once); its admission slot goes
    when its handler gives up on the write (``stall_s``)."""
    stats = await idle(server, timeout_s=20.0)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert server.engine.kv.check_invariants() is None
    reservations = server.service.reservations
    await _until(lambda: reservations.count == 0, "the worker's handler ended")


async def test_a_router_client_that_never_reads_is_cancelled_and_frees_its_blocks(long_fleet):
    server = await _replica(long_fleet)
    router = await long_fleet.add_router(stream_limits=LIMITS)
    await long_fleet.wait_replicas(1)
    async with grpc.aio.insecure_channel(router.address, options=SMALL_WINDOW) as slow_ch, \
            grpc.aio.insecure_channel(router.address) as channel:
        slow = router_pb2_grpc.RouterStub(slow_ch).Generate(_router_request(LONG, 1))
        normal = await _drain(router_pb2_grpc.RouterStub(channel).Generate(
            _router_request(200, 2)))
        assert normal == (200, "OK", "")  # beside the stalled stream
        await _assert_freed(server)  # the worker aborted the unread stream
        core = router.core
        await _until(lambda: core.tenant_inflight["default"] == 0, "router relay ended")
        assert sum(router.replicas.ledger.inflight.values()) == 0
        tokens, code, details = await _drain(slow)  # now read what is left
    assert tokens < LONG
    assert code == "RESOURCE_EXHAUSTED"
    assert "stream cancelled" in details


async def test_a_direct_worker_client_that_never_reads_is_aborted(long_fleet):
    server = await _replica(long_fleet)
    async with grpc.aio.insecure_channel(server.address, options=SMALL_WINDOW) as slow_ch, \
            grpc.aio.insecure_channel(server.address) as channel:
        def request(rid: str, max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
            req = worker_pb2.WorkerGenerateRequest(request_id=rid, tenant="default",
                                                   prompt_token_ids=prompt(3, 20))
            req.sampling.max_tokens, req.sampling.ignore_eos = max_tokens, True
            return req

        slow = worker_pb2_grpc.WorkerStub(slow_ch).Generate(request("slow", LONG))
        normal = await _drain(worker_pb2_grpc.WorkerStub(channel).Generate(
            request("normal", 200)))
        assert normal == (200, "OK", "")
        await _assert_freed(server)
        tokens, code, details = await _drain(slow)
    assert tokens < LONG
    assert code == "RESOURCE_EXHAUSTED"
    assert "stream cancelled" in details


async def test_an_sse_client_that_never_reads_is_disconnected(long_fleet):
    server = await _replica(long_fleet)
    router = await long_fleet.add_router(stream_limits=LIMITS, http_port=0)
    await long_fleet.wait_replicas(1)
    host, port = router.http_address.rsplit(":", 1)
    body = json.dumps({"model": "tiny-llama", "prompt": prompt(4, 20), "max_tokens": LONG,
                       "ignore_eos": True, "stream": True}).encode()
    # A client that reads nothing, with a tiny receive buffer (its TCP window) and a small
    # segment size: the server's send buffer is sized from the segment size (on loopback,
    # 64 KB segments would let it absorb megabytes before the router's writes wait).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                      b"content-type: application/json\r\n"
                                      b"content-length: %d\r\n\r\n" % len(body) + body)
        async with grpc.aio.insecure_channel(router.address) as channel:
            normal = await _drain(router_pb2_grpc.RouterStub(channel).Generate(
                _router_request(200, 5)))
        assert normal == (200, "OK", "")
        await _assert_freed(server)
        core = router.core
        await _until(lambda: core.tenant_inflight["default"] == 0, "SSE relay ended")
        received = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10):
            received += chunk  # the server closed the connection: the stream ends here
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in received
    assert received.count(b"data: ") < LONG
