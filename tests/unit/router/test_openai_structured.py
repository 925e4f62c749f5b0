"""response_format, guided_* fields and tools on the OpenAI front: parsing and response shapes."""

from __future__ import annotations

import json

import pytest

from kvfleet.constraint import MAX_SCHEMA_DEPTH, Constraint
from kvfleet.errors import InvalidArgument
from kvfleet.router.openai_request import parse_chat, parse_completion
from kvfleet.router.openai_response import ResponseBuilder
from kvfleet.v1 import common_pb2

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}


def field_of(body: dict) -> str:
    with pytest.raises(InvalidArgument) as err:
        parse_chat({"messages": HI, **body})
    return err.value.field


def test_response_formats_and_guided_fields_become_constraints():
    c = parse_chat({"messages": HI, "response_format": {"type": "json_object"}}).constraint
    assert (c.kind, c.field) == ("json_object", "response_format")
    c = parse_chat({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}).inputs[0].constraint
    assert c.kind == "json_schema" and json.loads(c.spec) == SCHEMA
    assert c.field == "response_format.json_schema.schema"
    assert parse_chat({"messages": HI, "response_format": {"type": "text"}}).constraint is None
    assert parse_chat({"messages": HI, "guided_json": json.dumps(SCHEMA)}).constraint.kind == \
        "json_schema"
    c = parse_completion({"prompt": "x", "guided_regex": "[0-9]+"}).inputs[0].constraint
    assert (c.kind, c.spec, c.field) == ("regex", "[0-9]+", "guided_regex")
    c = parse_completion({"prompt": "x", "guided_grammar": 'root ::= "a"'}).constraint
    assert c.kind == "grammar"


def test_an_http_schema_keeps_its_property_order_which_is_the_outputs_key_order():
    schema = {"type": "object", "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}}}
    c = parse_chat({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema}}}).constraint
    assert list(json.loads(c.spec)) == list(schema)
    assert list(json.loads(c.spec)["properties"]) == ["zeta", "alpha"]


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "not": {}}}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"guided_regex": "a" * 10_000}, "guided_regex"),
    ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x-y": 1}}}]},
     "tools[0].function.parameters"),
])
def test_bad_structured_fields_name_the_field(body, field):
    assert field_of(body) == field


def test_tools_required_named_auto_none():
    req = parse_chat({"messages": [{"role": "system", "content": "be brief"}, *HI],
                      "tools": [TOOL], "tool_choice": "required"})
    msgs = req.inputs[0].prompt.messages
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("be brief\n\n")
    assert '"add"' in msgs[0]["content"] and req.tools == ("add",)
    schema = json.loads(req.constraint.spec)
    assert schema["properties"]["name"] == {"const": "add"}
    assert schema["properties"]["arguments"] == SCHEMA
    named = parse_chat({"messages": HI, "tools": [TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.constraint.spec == req.constraint.spec
    auto = parse_chat({"messages": HI, "tools": [TOOL]})
    assert auto.constraint is None and auto.tools == ("add",)
    assert auto.inputs[0].prompt.messages[0]["role"] == "system"
    none = parse_chat({"messages": HI, "tools": [TOOL], "tool_choice": "none"})
    assert none.constraint is None and none.tools == () and none.inputs[0].prompt.messages == HI


def test_earlier_tool_calls_are_rendered_into_the_conversation():
    req = parse_chat({"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]})
    msgs = req.inputs[0].prompt.messages
    assert json.loads(msgs[1]["content"]) == {"name": "add", "arguments": {"a": 1}}
    assert msgs[2] == {"role": "tool", "content": "3"}


def _msg(text: str, finish: bool) -> common_pb2.GenerateResponse:
    m = common_pb2.GenerateResponse(text=text)
    if finish:
        m.finish_reason = common_pb2.STOP
    return m


def test_tool_call_in_body_and_in_one_stream_chunk():
    call = '{"name": "add", "arguments": {"a": 2}}'
    b = ResponseBuilder(True, "r", "m", 1, None, str, tools=("add",))
    b.add(0, _msg(call, True))
    choice = b.body()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    fn = choice["message"]["tool_calls"][0]["function"]
    assert fn["name"] == "add" and json.loads(fn["arguments"]) == {"a": 2}
    s = ResponseBuilder(True, "r", "m", 1, None, str, tools=("add",))
    assert s.chunk(0, _msg(call[:10], False), False) is None  # held until the choice ends
    chunk = s.chunk(0, _msg(call[10:], True), False)["choices"][0]
    assert chunk["finish_reason"] == "tool_calls" and chunk["delta"]["tool_calls"][0]["index"] == 0
    plain = ResponseBuilder(True, "r", "m", 1, None, str, tools=("add",))
    chunk = plain.chunk(0, _msg("no call", True), False)["choices"][0]
    assert chunk["delta"] == {"content": "no call"} and chunk["finish_reason"] == "stop"


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("depth", [MAX_SCHEMA_DEPTH, 5000])
def test_a_deeply_nested_schema_is_invalid_argument_naming_its_field(depth):
    deep = nested(depth)
    text = '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth
    for body, field in (({"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": deep}}}, "response_format.json_schema.schema"),
            ({"guided_json": text}, "guided_json"), ({"guided_json": deep}, "guided_json")):
        with pytest.raises(InvalidArgument, match=f"{field} nests deeper than "
                                                  f"{MAX_SCHEMA_DEPTH} levels") as err:
            parse_chat({"messages": HI, **body})
        assert err.value.field == field
    with pytest.raises(InvalidArgument, match="json_schema nests deeper") as err:
        Constraint("json_schema", '{"items":' * depth + "{}" + "}" * depth,  # within 64 KiB
                   "json_schema").validate()  # the gRPC field
    assert err.value.field == "json_schema"
    ok = nested(MAX_SCHEMA_DEPTH - 1)  # the bound itself is accepted
    assert parse_chat({"messages": HI, "guided_json": ok}).constraint.kind == "json_schema"
