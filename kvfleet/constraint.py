"""Structured-output constraints: what a request's output must match, shared by router and worker.

A :class:`Constraint` is one of ``json_object`` (any JSON object), ``json_schema`` (a JSON Schema
document), ``regex`` or ``grammar`` (EBNF, start rule ``root``). The router checks what it can
cheaply (size, JSON syntax); the worker compiles it (:mod:`kvfleet.worker.engine.output.grammar`) and
refuses what does not compile, both with :class:`~kvfleet.errors.InvalidArgument` naming the field.
"""

from __future__ import annotations

import functools
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
# CPU milliseconds one row's token mask may take in a step (far above a typical fill).
DEFAULT_MASK_BUDGET_MS = 50.0


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds of constraint compilation and masking on a replica.

    ``max_compile_s``: a constraint whose compile takes longer is refused (INVALID_ARGUMENT),
    and so is its digest from then on; a compile also waits at most this long for a thread
    (then RESOURCE_EXHAUSTED, retryable). ``cache_size``: compiled grammars kept (LRU), and
    as many digests remembered as too slow. ``threads``: compile threads; ``tenant_compiles``:
    compiles one tenant may run at once (below ``threads``, one tenant's slow schemas leave a
    thread to the others); ``max_queued``: one tenant's compiles waiting for a thread, past
    which its new ones are refused (RESOURCE_EXHAUSTED). ``mask_budget_ms``: CPU milliseconds
    one row's token mask may take in a step; a request past it is ended (INVALID_ARGUMENT)
    and its constraint refused from then on.

    Raises:
        ValueError: a bound out of its range (naming it).
    """

    max_compile_s: float = DEFAULT_MAX_COMPILE_S
    cache_size: int = DEFAULT_CACHE_SIZE
    threads: int = 2
    tenant_compiles: int = 1
    max_queued: int = 8
    mask_budget_ms: float = DEFAULT_MASK_BUDGET_MS

    def __post_init__(self) -> None:
        if not self.max_compile_s > 0:
            raise ValueError(f"max_compile_s must be > 0, got {self.max_compile_s}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 1 <= self.tenant_compiles <= self.threads:
            raise ValueError(f"tenant_compiles must be in [1, threads={self.threads}], "
                             f"got {self.tenant_compiles}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not self.mask_budget_ms > 0:
            raise ValueError(f"mask_budget_ms must be > 0, got {self.mask_budget_ms}")


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

    @functools.cached_property
    def canonical_spec(self) -> str:
        """What the worker compiles and :attr:`digest` hashes: a JSON schema without the
        annotations that never change its grammar (:data:`ANNOTATIONS`, e.g. ``title``), its
        keywords sorted and its properties in their order (:func:`canonical_schema`), as
        compact JSON; any other spec (or a schema that does not parse) as it is."""
        if self.kind != "json_schema":
            return self.spec
        try:
            return json.dumps(canonical_schema(json.loads(self.spec)), separators=(",", ":"))
        except (ValueError, RecursionError):
            return self.spec  # refused by validate(), which names the field

    @property
    def digest(self) -> str:
        """sha256 hex of (kind, :attr:`canonical_spec`): the compile cache key, the same for
        schemas that differ only in annotations (``field`` is not part of it)."""
        h = hashlib.sha256(self.kind.encode() + b"\0")
        h.update(self.canonical_spec.encode())
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


# Annotation keywords: xgrammar's converter ignores them, so they never change a grammar
# (tests/unit/worker/engine/output/test_compile_limits.py checks that against xgrammar).
ANNOTATIONS = frozenset(("title", "description", "$comment", "examples", "default",
                         "deprecated", "readOnly", "writeOnly"))
_UNORDERED_MAPS = ("$defs", "definitions")  # referenced by name: their order means nothing


def canonical_schema(schema: Any) -> Any:
    """``schema`` (parsed JSON) without :data:`ANNOTATIONS` at any schema position (a property
    *named* ``title`` stays), with each schema's keywords and its ``$defs`` sorted; the order
    of ``properties`` is kept (it is the order the output's keys take)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key in sorted(schema):
        value = schema[key]
        if key in ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            items = sorted(value.items()) if key in _UNORDERED_MAPS else value.items()
            value = {name: canonical_schema(sub) for name, sub in items}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [canonical_schema(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            value = canonical_schema(value)
        out[key] = value
    return out
