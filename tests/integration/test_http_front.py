"""The OpenAI-compatible HTTP front with the real ``openai`` client, against the tiny cluster
(router process with --http-port, Ray-actor replicas of the tiny seeded Llama, Redis).
Auth, disconnects, 409 and 429: tests/integration/test_http_front_edges.py."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from kvfleet.client import Client
from tests.integration.test_cluster import SYSTEM_A, SYSTEM_B, chat, idle_free_blocks

GREEDY = dict(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def base_url(tiny_cluster) -> str:
    return f"http://{tiny_cluster.http_address}/v1"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(tiny_cluster):
    with Client(tiny_cluster.router_address) as c:
        yield c


def all_blocks_free(cluster) -> None:
    for addr in cluster.replica_addresses:
        s = idle_free_blocks(addr)
        assert s.num_free_blocks == s.num_total_blocks  # cached blocks are evictable: free


def test_chat_text_equals_the_grpc_answer_streaming_or_not(oai, grpc_client):
    messages = chat(SYSTEM_A, "Which planet has the most moons?")
    want = grpc_client.generate(messages=messages, **GREEDY)
    resp = oai.chat.completions.create(model="tiny-llama", messages=messages, **GREEDY)
    assert resp.object == "chat.completion" and resp.model == "tiny-llama"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model="tiny-llama", messages=messages, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == resp.choices[0].finish_reason


def test_completions_default_to_16_tokens_and_take_arrays_of_prompts(oai, grpc_client):
    one = oai.completions.create(model="tiny-llama", prompt="Once upon a time", temperature=0,
                                 extra_body={"ignore_eos": True})
    assert one.object == "text_completion" and one.usage.completion_tokens == 16
    assert one.choices[0].text == grpc_client.generate("Once upon a time", max_tokens=16,
                                                       ignore_eos=True)
    many = oai.completions.create(model="tiny-llama", prompt=["Once upon a time", "Far away"],
                                  max_tokens=4, n=2, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy
    assert one.choices[0].text.startswith(many.choices[0].text)
    assert many.choices[2].text == grpc_client.generate("Far away", max_tokens=4, ignore_eos=True)
    ids = oai.completions.create(model="tiny-llama", prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=2,
                                 temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6
    assert many.usage.completion_tokens == 16


def test_n_2_gives_two_choices(oai):
    resp = oai.chat.completions.create(model="tiny-llama", messages=chat(SYSTEM_B, "Bake?"),
                                       n=2, max_tokens=6, temperature=1.0, seed=11)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.message.content for c in resp.choices)
    stream = oai.chat.completions.create(model="tiny-llama", messages=chat(SYSTEM_B, "Bake?"),
                                         n=2, max_tokens=6, temperature=1.0, seed=11, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in resp.choices}  # same seed, same draws


def test_stop_strings_end_the_text_before_them(oai):
    messages = chat(SYSTEM_A, "Name a comet.")
    full = oai.chat.completions.create(model="tiny-llama", messages=messages, temperature=0,
                                       max_tokens=24).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = oai.chat.completions.create(model="tiny-llama", messages=messages, temperature=0,
                                      max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]


def test_logprobs_in_the_chat_and_the_completions_shapes(oai):
    resp = oai.chat.completions.create(model="tiny-llama", messages=chat(SYSTEM_A, "Moons?"),
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top one
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    comp = oai.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


async def test_the_async_client_streams(base_url, grpc_client):
    messages = chat(SYSTEM_B, "How long should dough rest?")
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(model="tiny-llama", messages=messages,
                                                      stream=True, **GREEDY)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == grpc_client.generate(messages=messages, **GREEDY)


@pytest.mark.parametrize("kwargs, grpc_kwargs, param", [
    (dict(temperature=-0.5), dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), dict(top_p=1.5), "top_p"),
    (dict(n=99), dict(n=99), "n"),
    (dict(logprobs=True, top_logprobs=50), dict(logprobs=50), "top_logprobs"),
])
def test_a_bad_value_is_a_400_with_the_grpc_message(oai, grpc_client, kwargs, grpc_kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny-llama", messages=chat(SYSTEM_A, "hi"),
                                    max_tokens=4, **kwargs)
    with pytest.raises(grpc.RpcError) as rpc:
        list(grpc_client.stream(messages=chat(SYSTEM_A, "hi"), max_tokens=4, **grpc_kwargs))
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_argument"
    assert body["message"] == rpc.value.details()


@pytest.mark.parametrize("body, status, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, 400,
     "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}}}}}, 400,
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, 400, "guided_regex"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0].type"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]}, 413, "messages"),
])
def test_bad_requests_get_their_status_and_param_and_leak_nothing(tiny_cluster, base_url, body,
                                                                   status, param):
    request = {"model": "tiny-llama", "messages": chat(SYSTEM_A, "hi"), "max_tokens": 4, **body}
    resp = httpx.post(f"{base_url}/chat/completions", json=request, timeout=30)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
    all_blocks_free(tiny_cluster)


def test_unsupported_completion_fields_and_parts(base_url):
    resp = httpx.post(f"{base_url}/completions", json={"prompt": "hi", "echo": True}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"
    resp = httpx.post(f"{base_url}/completions", content=b"{not json", timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "comet."}]
    resp = httpx.post(f"{base_url}/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0})
    joined = httpx.post(f"{base_url}/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "Name a\ncomet."}], "max_tokens": 2,
        "temperature": 0})
    assert resp.status_code == 200 and resp.json()["choices"] == joined.json()["choices"]


def test_a_deadline_is_a_504(base_url):
    resp = httpx.post(f"{base_url}/completions", headers={"x-request-timeout": "0.05"}, json={
        "prompt": "Count to a thousand.", "max_tokens": 240, "ignore_eos": True}, timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"


def test_a_repeated_chat_prompt_reports_cached_tokens(oai):
    messages = chat(SYSTEM_A + " Always add one fun fact about Saturn.", "What is a comet?")
    first = oai.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)
    second = oai.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_and_health(oai, base_url):
    # The model, then the LoRA adapters its replicas serve (tests/fixtures/cluster.py).
    assert [m.id for m in oai.models.list().data] == ["tiny-llama", "all", "qv"]
    resp = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=30)
    assert resp.status_code == 200 and resp.json()["replicas"] == 2
