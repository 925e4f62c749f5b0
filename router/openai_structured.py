"""Structured output and tool calling on the OpenAI front: request fields → a Constraint.

Accepted (at most one constraint per request):

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (OpenAI's shape);
- vLLM's extension fields ``guided_json`` (a schema object or its JSON text),
  ``guided_regex``, ``guided_grammar`` (EBNF, start rule ``root``);
- chat only: ``tools`` (``type: function`` with ``name``, ``parameters``) and ``tool_choice``
  ``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name"}}``.
  ``required`` and a named function constrain the output to one call
  ``{"name": ..., "arguments": {...}}`` whose arguments match that tool's ``parameters``;
  ``auto`` leaves the output free and returns a call if the whole output is one.
  The tools are described to the model in a system message (SmolLM2's chat template has no
  tool format); one call per response (``parallel_tool_calls`` is not honoured).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from kvfleet.constraint import MAX_SCHEMA_DEPTH, Constraint, check_json_depth, too_deep
from kvfleet.errors import InvalidArgument

STRUCTURED_FIELDS = {"response_format", "guided_json", "guided_regex", "guided_grammar"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
MAX_TOOLS = 64


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tools`` ask for.

    ``mode``: ``"none"`` (no tools, or ``tool_choice: none``), ``"auto"``, ``"required"`` or
    ``"named"``; ``names``: the tools a call may name; ``system``: the tool description to
    prepend to the conversation (``""`` when none); ``constraint``: the call's JSON schema
    (required / named), else None.
    """

    mode: str = "none"
    names: tuple[str, ...] = ()
    system: str = ""
    constraint: Optional[Constraint] = None


def _schema_constraint(schema: Any, field: str) -> Constraint:
    if isinstance(schema, str):
        text = schema
    elif isinstance(schema, (dict, bool)):
        check_json_depth(schema, MAX_SCHEMA_DEPTH, field)  # before json.dumps recurses into it
        text = json.dumps(schema, separators=(",", ":"))  # property order is output order
    else:
        raise InvalidArgument(f"{field} must be a JSON Schema object", field=field)
    return Constraint("json_schema", text, field).validate()


def _response_format(value: Any) -> Optional[Constraint]:
    if not isinstance(value, dict):
        raise InvalidArgument("response_format must be an object", field="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", "response_format").validate()
    if kind != "json_schema":
        raise InvalidArgument("response_format.type must be 'text', 'json_object' or "
                              f"'json_schema', got {kind!r}", field="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument("response_format.json_schema must be an object",
                              field="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("response_format.json_schema.name must be a non-empty string",
                              field="response_format.json_schema.name")
    if "schema" not in spec:  # OpenAI: no schema = any JSON object
        return Constraint("json_object", "", "response_format.json_schema").validate()
    return _schema_constraint(spec["schema"], "response_format.json_schema.schema")


def parse_constraint(body: dict) -> Optional[Constraint]:
    """The one structured-output constraint a body asks for, or None.

    Raises:
        InvalidArgument: a malformed field, or more than one constraint (naming the field).
    """
    found: list[Constraint] = []
    if body.get("response_format") is not None:
        c = _response_format(body["response_format"])
        if c is not None:
            found.append(c)
    if body.get("guided_json") is not None:
        value = body["guided_json"]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise too_deep("guided_json", MAX_SCHEMA_DEPTH) from None
            except ValueError as exc:
                raise InvalidArgument(f"guided_json is not valid JSON: {exc}",
                                      field="guided_json") from None
        found.append(_schema_constraint(value, "guided_json"))
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidArgument(f"{name} must be a string", field=name)
            found.append(Constraint(kind, value, name).validate())
    if len(found) > 1:
        raise InvalidArgument("set at most one of response_format (json_object / json_schema), "
                              "guided_json, guided_regex, guided_grammar, and no tool_choice "
                              "required / named with them", field=found[1].field)
    return found[0] if found else None


def _tool(i: int, tool: Any) -> tuple[str, dict]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidArgument(f"{where}.type must be 'function'", field=f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidArgument(f"{where}.function.name must be a non-empty string",
                              field=f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidArgument(f"{where}.function.parameters must be a JSON Schema object",
                              field=f"{where}.function.parameters")
    _schema_constraint(params, f"{where}.function.parameters")  # its keywords, its size
    return fn["name"], {"name": fn["name"], "description": fn.get("description", ""),
                        "parameters": params}


def _call_schema(tool: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             "arguments": tool["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_tools(body: dict) -> ToolPlan:
    """The :class:`ToolPlan` of a chat body. Raises InvalidArgument naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise InvalidArgument("tool_choice needs tools", field="tool_choice")
        return ToolPlan()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools must be an array of at most {MAX_TOOLS} tools",
                              field="tools")
    defs = dict(_tool(i, t) for i, t in enumerate(tools))
    if len(defs) != len(tools):
        raise InvalidArgument("tools: function names must be distinct", field="tools")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan()
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if name not in defs:
            raise InvalidArgument(f"tool_choice.function.name must name one of the tools "
                                  f"{sorted(defs)}, got {name!r}", field="tool_choice")
        mode, allowed = "named", [defs[name]]
    elif choice in ("auto", "required"):
        mode, allowed = choice, list(defs.values())
    else:
        raise InvalidArgument("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}",
                              field="tool_choice")
    system = ("You can call these functions (JSON Schema of each one's arguments):\n"
              + json.dumps(allowed, sort_keys=True) + "\nTo call one, answer with only a JSON "
              'object {"name": <function name>, "arguments": <its arguments>}.')
    constraint = None
    if mode != "auto":
        schemas = [_call_schema(t) for t in allowed]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        constraint = _schema_constraint(schema, "tools")
    return ToolPlan(mode, tuple(t["name"] for t in allowed), system, constraint)


def parse_tool_call(text: str, names: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """``(name, arguments JSON)`` if ``text`` is exactly one call of a tool in ``names``."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and call.get("name") in names
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"])
