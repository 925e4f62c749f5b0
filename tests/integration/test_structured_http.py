"""Structured output and tool calls with the real ``openai`` client against a fleet serving
SmolLM2-135M-Instruct: a router with its HTTP front and one replica, in process (real gRPC, real
Redis; the Serve path is tests/integration/test_cluster.py's)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.integration.routing_fleet import Fleet

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "address": {"type": "object", "additionalProperties": False,
                                     "required": ["city", "country"],
                                     "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "country": {"type": "string",
                                                                "maxLength": 24}}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["sky", "celsius"],
           "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                          "celsius": {"type": "integer", "minimum": -50, "maximum": 50}}}
PLANETS = {"type": "object", "additionalProperties": False, "required": ["planets"],
           "properties": {"planets": {"type": "array", "minItems": 2, "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 12}}}}
ASKS = [(PERSON, "Describe a fictional person as JSON: name, age and address."),
        (WEATHER, "What is the weather like in Paris in winter? Answer as JSON."),
        (PLANETS, "Name two or three planets of the solar system, as JSON.")]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {
             "name": "add", "description": "Add two integers",
             "parameters": {"type": "object", "required": ["a", "b"],
                            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def oai(redis_server, smollm2_dir):
    """The openai client of an in-process fleet: one SmolLM2 replica (real model runner, 16-token
    blocks, 256 of them) and a router with its HTTP front, on an event loop of their own thread
    (the tests' client calls block)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="structured-fleet", daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    fleet = Fleet(redis_server.url, "kvtest-structured:", str(smollm2_dir), model_name="smollm2")
    try:
        call(fleet.add_replica("smollm2", executor="model", num_blocks=256, num_threads=2))
        router = call(fleet.add_router(http_port=0))
        call(fleet.wait_replicas(1))
        with openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=600) as client:
            yield client
    finally:
        call(fleet.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def ask(oai, prompt: str, **kw):
    kw.setdefault("max_tokens", 96)
    return oai.chat.completions.create(model="smollm2",
                                       messages=[{"role": "user", "content": prompt}], **kw)


@pytest.mark.parametrize("schema, prompt", ASKS)
def test_json_schema_strict_output_validates(oai, schema, prompt):
    resp = ask(oai, prompt, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and valid(choice.message.content, schema), choice


def test_mask_off_at_temperature_1_gives_invalid_output(oai):
    """Negative control: the same prompts, sampled, without response_format. The requests go
    concurrently (the replica batches them), as a client fleet would send them."""
    fmt = [{"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
           for schema, _ in ASKS]
    calls = [dict(prompt=prompt, temperature=1.0, seed=seed, max_tokens=48)
             for _, prompt in ASKS for seed in (1, 2)]
    calls += [dict(prompt=prompt, temperature=1.0, seed=seed, response_format=f)
              for (_, prompt), f in zip(ASKS, fmt, strict=True) for seed in (1, 2)]
    with ThreadPoolExecutor(len(calls)) as pool:
        texts = list(pool.map(lambda kw: ask(oai, kw.pop("prompt"), **kw).choices[0].message.content,
                              calls))
    schemas = [schema for schema, _ in ASKS for _ in (1, 2)]
    free, masked = texts[:len(schemas)], texts[len(schemas):]
    assert not all(valid(t, s) for t, s in zip(free, schemas, strict=True)), free
    assert all(valid(t, s) for t, s in zip(masked, schemas, strict=True)), masked


def test_json_object_and_a_date_regex(oai):
    resp = ask(oai, "Reply with a JSON object with one key, name, holding a cat's name.",
               temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop", resp.choices[0]
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    resp = ask(oai, "When did the Apollo 11 mission land on the Moon?", temperature=0,
               extra_body={"guided_regex": r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", resp.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_a_valid_call(oai, stream):
    kw = dict(temperature=0, tools=TOOLS, tool_choice="required")
    if not stream:
        msg = ask(oai, "What is the weather in Tokyo, in celsius?", **kw).choices[0]
        assert msg.finish_reason == "tool_calls" and msg.message.content is None
        calls = msg.message.tool_calls
    else:
        chunks = list(ask(oai, "What is the weather in Tokyo, in celsius?", stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = deltas[0].tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["parameters"])


def test_named_tool_and_bad_schema(oai):
    resp = ask(oai, "Add 2 and 3.", temperature=0, tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "add"}})
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    with pytest.raises(openai.BadRequestError) as err:
        ask(oai, "hi", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "does not compile" in err.value.body["message"]
