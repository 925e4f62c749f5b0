"""The HTTP front's edges, on an in-process fleet (a slow cost-model replica: real scheduler,
block pool, gRPC; a real router with an API-key file and its HTTP front; real Redis): keys,
clients that leave, a duplicate live id, a full queue."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel

STEP = CostModel(0.02, 0.0, 0.0, "test: 20 ms per step")  # a request of 100 tokens takes ~2 s
KEY = "key-acme"
LONG = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}


@pytest.fixture
async def front(fleet, tmp_path):
    """(base URL, replica server, finish reasons the engine reported) of a one-replica fleet."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY: "acme"}))
    server = await fleet.add_replica("rep-a", cost_model=STEP, scheduler=SchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=256, max_waiting=1))
    finished: list[FinishReason] = []
    loop = server._loop
    report = loop.on_finish
    loop.on_finish = lambda out: (finished.append(out.finish_reason), report(out))
    router = await fleet.add_router(http_port=0, api_keys_file=str(keys))
    await fleet.wait_replicas(1)
    return f"http://{router.http_address}/v1", server, finished


async def until(predicate, what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


async def assert_idle_and_free(server) -> None:
    await until(lambda: server._loop.stats["running"] == server._loop.stats["waiting"] == 0,
                "replica idle")
    stats = server._loop.stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def auth(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


async def test_a_missing_or_unknown_key_is_a_401(front):
    base, _, _ = front
    async with openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as err:
            await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
        assert err.value.body["message"] == "unknown API key"
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with httpx.AsyncClient() as client:
        resp = await client.post(f"{base}/completions", json={"prompt": "hi"})
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
        ok = await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_cancels_its_request_and_frees_its_blocks(front, stream):
    base, server, finished = front
    async with httpx.AsyncClient(timeout=30) as client:
        if stream:
            async with client.stream("POST", f"{base}/completions", headers=auth(),
                                     json={**LONG, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk, then the connection closes
        else:
            post = asyncio.create_task(client.post(f"{base}/completions", headers=auth(), json=LONG))
            await until(lambda: server._loop.stats["running"] == 1, "request running")
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post
    await until(lambda: finished, "request finished")
    assert finished == [FinishReason.CANCELLED]
    await assert_idle_and_free(server)


async def test_a_duplicate_live_request_id_is_a_409_and_a_full_queue_a_429(front):
    base, server, finished = front
    async with httpx.AsyncClient(timeout=30) as client:
        def post(request_id: str):
            return asyncio.create_task(client.post(
                f"{base}/completions", json=LONG,
                headers={**auth(), "x-request-id": request_id}))

        first = post("req-1")
        await until(lambda: server._loop.stats["running"] == 1, "first request running")
        dup = await post("req-1")
        assert dup.status_code == 409, dup.text
        assert dup.json()["error"]["code"] == "already_exists"
        second = post("req-2")
        await until(lambda: server._loop.stats["waiting"] == 1, "second request waiting")
        full = await post("req-3")
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert "at its limit" in full.json()["error"]["message"]  # refused before any queue
        for task in (first, second):
            resp = await task
            assert resp.status_code == 200 and resp.headers["x-request-id"] in ("req-1", "req-2")
            assert resp.json()["id"] == "cmpl-" + resp.headers["x-request-id"]
    await assert_idle_and_free(server)


async def test_an_error_after_the_stream_started_is_an_error_event_without_done(front, fleet):
    base, server, _ = front
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{base}/completions", headers=auth(),
                                 json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            events = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        await fleet.replicas.pop("rep-a").stop(grace_s=0)  # gone mid-stream
    assert json.loads(events[0])["choices"][0]["text"]
    error = json.loads(events[-1])["error"]  # the last event, and no [DONE]
    assert error["code"] == "unavailable" and error["type"] == "service_unavailable_error"


async def test_no_live_replica_is_a_503_and_health_says_so(fleet):
    router = await fleet.add_router(http_port=0)
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}", timeout=30) as client:
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["replicas"] == 0
        resp = await client.post("/v1/completions", json={"prompt": "hi"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"
        assert "no live replica" in resp.json()["error"]["message"]


async def test_connections_past_the_limit_get_503_at_once(fleet):
    # Issue 24 item 2: the limit L served L - 1 connections (and 1 refused everything).
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(http_port=0, http_max_connections=2)
    await fleet.wait_replicas(1)
    host, port = router.http_address.rsplit(":", 1)
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}") as client:
        assert (await client.get("/health")).status_code == 200
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]  # both slots
    try:
        async with httpx.AsyncClient(base_url=f"http://{router.http_address}") as client:
            assert (await client.get("/health")).status_code == 503
    finally:
        for _, writer in idle:
            writer.close()
            await writer.wait_closed()
    await until(lambda: len(router.http._server.server_state.connections) == 0, "idle closed")
    idle = await asyncio.open_connection(host, int(port))  # one of two: the second is served
    try:
        async with httpx.AsyncClient(base_url=f"http://{router.http_address}") as client:
            assert (await client.get("/health")).status_code == 200
    finally:
        idle[1].close()
        await idle[1].wait_closed()


async def test_a_limit_of_one_connection_serves_one(fleet):
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(http_port=0, http_max_connections=1)
    await fleet.wait_replicas(1)
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}") as client:
        assert (await client.get("/health")).status_code == 200


async def test_shutdown_lets_http_streams_run_for_the_router_grace(fleet):
    # Issue 24 item 17: the HTTP front cut its streams after a hard-coded 2 s.
    await fleet.add_replica("rep-a", cost_model=STEP)
    router = await fleet.add_router(http_port=0, shutdown_grace_s=20.0)
    await fleet.wait_replicas(1)
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"http://{router.http_address}/v1/completions",
                                 json={**LONG, "max_tokens": 150, "stream": True,
                                       "stream_options": {"include_usage": True}}) as resp:
            events, stopping = [], None
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if stopping is None:  # ~3 s of stream left
                        stopping = asyncio.create_task(router.stop())
    await stopping
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 150


async def test_deep_nesting_is_a_400_naming_the_field_never_a_500(front):
    base, _, _ = front
    depth = 3000  # past the JSON reader's recursion limit
    schema = '{"type":"array","items":' * 200 + '{"type":"string"}' + "}" * 200
    bodies = {  # raw text: a client's JSON encoder could itself overflow on these
        "body": '{"prompt":"hi","user":' + "[" * depth + "]" * depth + "}",
        "response_format.json_schema.schema": '{"prompt":"hi","response_format":{"type":'
        '"json_schema","json_schema":{"name":"a","schema":' + schema + "}}}",
    }
    async with httpx.AsyncClient(timeout=30) as client:
        for field, text in bodies.items():
            resp = await client.post(f"{base}/completions", content=text,
                                     headers={**auth(), "content-type": "application/json"})
            assert resp.status_code == 400, (field, resp.status_code, resp.text[:200])
            assert resp.json()["error"]["message"].startswith(f"{field} nests deeper than"), field
