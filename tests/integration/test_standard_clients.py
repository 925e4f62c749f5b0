"""The request bodies the field's benchmark clients send, as they send them, through the HTTP
front: guidellm 0.8.1 (what vLLM users benchmark with) streams with
``stream_options: {include_usage, continuous_usage_stats}``, content parts, ``stop: null``,
``max_completion_tokens`` and ``ignore_eos``, and reads the token counts from the chunks' usage.
``bench/cluster/guidellm_bench.py`` drives the front with guidellm itself where it is installed."""

from __future__ import annotations

import json

import httpx
import pytest

from kvfleet.worker.engine.scheduling.config import SchedulerConfig

MAX_TOKENS = 8
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# guidellm 0.8.1's OpenAI backend, format() of a text-column request with 8 output tokens.
GUIDELLM_CHAT = {"model": "tiny-llama", "stream": True, "stream_options": STREAM_OPTIONS,
                 "max_completion_tokens": MAX_TOKENS, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [
                     {"type": "text", "text": "Hello there, how are you"}]}]}
GUIDELLM_COMPLETION = {"model": "tiny-llama", "stream": True, "stream_options": STREAM_OPTIONS,
                       "max_tokens": MAX_TOKENS, "stop": None, "ignore_eos": True,
                       "prompt": "Hello there, how are you"}


async def sse(client: httpx.AsyncClient, route: str, body: dict) -> list:
    """The events of one streamed response (parsed JSON, then ``"[DONE]"``)."""
    events: list = []
    async with client.stream("POST", route, json=body) as resp:
        assert resp.status_code == 200, (await resp.aread())[:300]
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("route,body", [("/chat/completions", GUIDELLM_CHAT),
                                        ("/completions", GUIDELLM_COMPLETION)])
async def test_guidellm_bodies_stream_with_usage_in_every_chunk(fleet, route, body):
    await fleet.add_replica("rep-a", scheduler=SchedulerConfig(max_num_seqs=4,
                                                               max_num_batched_tokens=256))
    router = await fleet.add_router(http_port=0)
    await fleet.wait_replicas(1)
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}/v1", timeout=30) as client:
        events = await sse(client, route, body)
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == MAX_TOKENS
    prompt_tokens = last["usage"]["prompt_tokens"]
    assert prompt_tokens > 0
    content = [c for c in chunks if c["choices"] and (
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content"))]
    assert content  # every token arrived in some chunk
    so_far = [c["usage"]["completion_tokens"] for c in content]
    for c in content:  # the usage so far, in every chunk that carries tokens
        assert c["usage"]["prompt_tokens"] == prompt_tokens
        assert c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"]
    assert so_far == sorted(so_far) and 0 < so_far[0] and so_far[-1] == MAX_TOKENS


async def test_continuous_usage_without_include_usage_changes_nothing_and_a_bad_one_is_named(
        fleet):
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(http_port=0)
    await fleet.wait_replicas(1)
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}/v1", timeout=30) as client:
        events = await sse(client, "/completions", {**GUIDELLM_COMPLETION, "stream_options": {
            "continuous_usage_stats": True}})  # as vLLM: usage only with include_usage
        assert all("usage" not in e for e in events[:-1]) and events[-1] == "[DONE]"
        bad = await client.post("/completions", json={**GUIDELLM_COMPLETION, "stream_options": {
            "include_usage": True, "continuous_usage_stats": "yes"}})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "stream_options.continuous_usage_stats"
