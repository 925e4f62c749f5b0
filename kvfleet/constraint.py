"""Structured-output constraints: what a request's output must match, shared by router and worker.

A :class:`Constraint` is one of ``json_object`` (any JSON object), ``json_schema`` (a JSON Schema
document), ``regex`` or ``grammar`` (EBNF, start rule ``root``). The router checks what it can
cheaply (size, JSON syntax); the worker compiles it (:mod:`kvfleet.worker.engine.output.grammar`) and
refuses what does not compile, both with :class:`~kvfleet.errors.InvalidArgument` naming the field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

from kvfleet.errors import InvalidArgument

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar larger than this is refused
MAX_REGEX_BYTES = 4 * 1024  # regexes compile to automata that grow fast with their length
# JSON nesting levels of a schema: compiles grow fast with depth (an array nested a few
# hundred levels takes seconds), and deeper documents overflow recursive readers.
MAX_SCHEMA_DEPTH = 128
DEFAULT_MAX_COMPILE_S = 10.0
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds of constraint compilation on a replica.

    ``max_compile_s``: a constraint whose compile takes longer is refused (INVALID_ARGUMENT);
    ``cache_size``: compiled grammars kept (LRU); ``threads``: compile threads.
    """

    max_compile_s: float = DEFAULT_MAX_COMPILE_S
    cache_size: int = DEFAULT_CACHE_SIZE
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.max_compile_s > 0:
            raise ValueError(f"max_compile_s must be > 0, got {self.max_compile_s}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint.

    ``kind``: one of :data:`KINDS`; ``spec``: the schema (JSON text), regex or grammar text
    (``""`` for ``json_object``). ``field`` names the request field it came from, for errors
    (``"json_schema"`` over gRPC, ``"response_format.json_schema.schema"`` over HTTP, ...).
    """

    kind: str
    spec: str = ""
    field: str = ""

    def validate(self) -> "Constraint":
        """Cheap checks (kind, size, JSON syntax of a schema); returns self.

        Raises:
            InvalidArgument: naming ``self.field`` (or the kind).
        """
        name = self.field or self.kind
        if self.kind not in KINDS:
            raise InvalidArgument(f"constraint kind {self.kind!r} is not one of {KINDS}", field=name)
        size = len(self.spec.encode())
        limit = MAX_REGEX_BYTES if self.kind == "regex" else MAX_SPEC_BYTES
        if size > limit:
            raise InvalidArgument(f"{name}: {size} bytes exceed the limit of {limit} bytes",
                                  field=name)
        if self.kind in ("regex", "grammar") and not self.spec.strip():
            raise InvalidArgument(f"{name} must not be empty", field=name)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except RecursionError:
                raise too_deep(name, MAX_SCHEMA_DEPTH) from None
            except ValueError as exc:
                raise InvalidArgument(f"{name} is not valid JSON: {exc}", field=name) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgument(f"{name} must be a JSON object (a JSON Schema)", field=name)
            check_json_depth(schema, MAX_SCHEMA_DEPTH, name)
            check_schema_keywords(schema, name)
        return self

    @property
    def digest(self) -> str:
        """sha256 hex of (kind, spec): the compile cache key (``field`` is not part of it)."""
        h = hashlib.sha256(self.kind.encode() + b"\0")
        h.update(self.spec.encode())
        return h.hexdigest()

    @classmethod
    def from_proto(cls, msg, prefix: str = "") -> Optional["Constraint"]:
        """The ``constraint`` oneof of a ``GenerateRequest`` / ``WorkerGenerateRequest``.

        Returns None when unset. Raises InvalidArgument (see :meth:`validate`).
        """
        kind = msg.WhichOneof("constraint")
        if kind is None:
            return None
        spec = "" if kind == "json_object" else getattr(msg, kind)
        return cls(kind, spec, prefix + kind).validate()

    def to_proto(self, msg) -> None:
        """Set the ``constraint`` oneof of a request message."""
        if self.kind == "json_object":
            msg.json_object = True
        else:
            setattr(msg, self.kind, self.spec)


def check_json_depth(value: Any, limit: int, name: str) -> None:
    """Refuse a parsed JSON value nested deeper than ``limit`` objects/arrays (a scalar is
    depth 0, ``[]`` depth 1), before anything recursive reads it. Iterative: any depth is safe.

    Raises:
        InvalidArgument: naming ``name``, with the JSON pointer where the limit is passed.
    """
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            continue
        if depth == limit:
            raise too_deep(name, limit, path)
        stack.extend((child, depth + 1, f"{path}/{key}" if len(path) < 120 else path)
                     for key, child in children)


def too_deep(name: str, limit: int, path: str = "") -> InvalidArgument:
    """The error for a JSON document nested deeper than ``limit`` levels."""
    where = f" (at {path[:120]}…)" if path else ""
    return InvalidArgument(f"{name} nests deeper than {limit} levels{where}", field=name)


# The JSON Schema keywords xgrammar's converter enforces or may ignore harmlessly (annotations);
# any other keyword would be silently ignored, so it is refused instead.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames",
               "additionalItems", "unevaluatedItems", "not", "contains")
_SCHEMA_VALUES = ("type", "required", "enum", "const", "pattern", "format", "minLength",
                  "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                  "multipleOf", "minItems", "maxItems", "uniqueItems", "minProperties",
                  "maxProperties", "$ref", "$schema", "$id", "$comment", "title", "description",
                  "default", "examples", "deprecated", "readOnly", "writeOnly", "strict",
                  "minContains", "maxContains", "contentEncoding", "contentMediaType")
_UNSUPPORTED = ("not", "contains", "dependentSchemas", "uniqueItems", "minContains",
                "maxContains", "if", "then", "else", "dependentRequired")
SCHEMA_KEYWORDS = frozenset(_SCHEMA_MAPS + _SCHEMA_LISTS + _SCHEMA_ONE + _SCHEMA_VALUES)


def check_schema_keywords(schema, name: str, path: str = "") -> None:
    """Refuse keywords the constraint would not enforce (unknown, or known but unsupported).

    Raises:
        InvalidArgument: naming ``name`` and the keyword's JSON pointer.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{name}{path or '/'}: a schema must be an object or a boolean",
                              field=name)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _UNSUPPORTED or key not in SCHEMA_KEYWORDS:
            raise InvalidArgument(f"{name}: keyword {key!r} at {where} is not supported by "
                                  "structured output", field=name)
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for prop, sub in value.items():
                check_schema_keywords(sub, name, f"{where}/{prop}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema_keywords(sub, name, f"{where}/{i}")
        elif key in _SCHEMA_ONE:
            check_schema_keywords(value, name, where)
