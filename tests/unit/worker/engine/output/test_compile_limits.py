"""Structured-output compiles under a tenant that sends slow schemas: each tenant runs its
share of the compile threads (another tenant's schema compiles at once), queues are bounded
(RESOURCE_EXHAUSTED, retryable), a digest that compiled too slowly is refused from then on,
annotations (``title``, ...) do not make a schema new, and a refused request costs no compile.

A fake compiler held on an event stands in for a slow schema: no test waits for real time to
pass but those bounded by ``max_compile_s`` (and asserts nothing about durations)."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest

from kvfleet.constraint import ANNOTATIONS, Constraint, GrammarConfig
from kvfleet.errors import InvalidArgument, ResourceExhausted
from kvfleet.worker.engine.output.grammar import GrammarCache, xgrammar_module


def schema(n: int, title: str = "", **extra) -> Constraint:
    """A two-field schema; ``n`` changes its grammar (a bound), ``title`` does not."""
    doc = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
           "properties": {"a": {"type": "string", "maxLength": n}, "b": {"type": "integer"}},
           **extra}
    if title:
        doc["title"] = title
    return Constraint("json_schema", json.dumps(doc), "response_format.json_schema.schema")


class HeldCompiler:
    """A fake compile: a constraint whose spec holds ``slow_mark`` waits for :attr:`gate`; each
    call is recorded in :attr:`started` (canonical specs, in order) before it waits."""

    def __init__(self, slow_mark: str = '"maxLength":1,') -> None:
        self.gate = threading.Event()
        self.slow_mark = slow_mark
        self.started: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, c: Constraint):
        with self.lock:
            self.started.append(c.canonical_spec)
        if self.slow_mark in c.canonical_spec:
            self.gate.wait()
        return ("compiled", c.canonical_spec)


def cache(compiler, **cfg) -> GrammarCache:
    return GrammarCache(None, 64, [0], GrammarConfig(**cfg), compiler=compiler)  # type: ignore[arg-type]


async def first_started(fake: HeldCompiler) -> None:
    """Wait until a compile thread has picked up a first call (threads start asynchronously;
    bounded so a broken cache fails the test's own assertion instead of hanging)."""
    for _ in range(2000):
        if fake.started:
            return
        await asyncio.sleep(0.005)


async def settle() -> None:
    """Let the event loop run what is ready (queued submissions, done callbacks)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_annotations_do_not_change_the_digest_but_the_grammar_does():
    base = schema(5)
    assert schema(5, title="run 7").digest == base.digest
    nested = json.loads(base.spec)
    for key in ANNOTATIONS:
        nested["properties"]["a"][key] = "x"
    assert Constraint("json_schema", json.dumps(nested)).digest == base.digest
    assert schema(6).digest != base.digest
    # A property *named* like an annotation is part of the grammar; so is property order.
    named = {"type": "object", "properties": {"title": {"type": "string"}}}
    assert "title" in Constraint("json_schema", json.dumps(named)).canonical_spec
    flipped = json.loads(base.spec)
    flipped["properties"] = dict(reversed(list(flipped["properties"].items())))
    assert Constraint("json_schema", json.dumps(flipped)).digest != base.digest


def test_xgrammar_ignores_every_annotation_the_digest_drops():
    """What makes canonicalising safe: each dropped keyword, at the root and in a property,
    leaves xgrammar's grammar as it was (fails if an xgrammar upgrade starts to read one)."""
    xgr = xgrammar_module()

    def grammar(doc) -> str:
        return str(xgr.Grammar.from_json_schema(json.dumps(doc), any_whitespace=False,
                                                strict_mode=True))

    base = json.loads(schema(5).spec)
    for key in sorted(ANNOTATIONS):
        doc = json.loads(schema(5).spec)
        doc[key] = {"a": "z", "b": 1} if key in ("default", "examples") else "note"
        doc["properties"]["a"][key] = "note"
        assert grammar(doc) == grammar(base), key
        assert Constraint("json_schema", json.dumps(doc)).canonical_spec == \
            Constraint("json_schema", json.dumps(base)).canonical_spec


async def test_a_tenants_slow_schemas_hold_one_thread_and_another_tenant_compiles_at_once():
    """Tenant a's 12 slow schemas (each a new grammar) are held; tenant b's schema still
    compiles: a runs one compile at a time, the rest of its wait in its own queue."""
    fake = HeldCompiler()
    grammars = cache(fake, threads=2, tenant_compiles=1, max_queued=16, max_compile_s=600)
    slow = [asyncio.create_task(grammars.compile_async(schema(1, title=f"t{i}", minProperties=i),
                                                       "a")) for i in range(12)]
    await settle()
    await first_started(fake)  # a's first compile is in its thread before b asks
    got = await grammars.compile_async(schema(20), "b")
    assert got == ("compiled", schema(20).canonical_spec)
    assert len(fake.started) == 2 and fake.started[1] == schema(20).canonical_spec
    assert not any(t.done() for t in slow)
    fake.gate.set()
    assert len(set(await asyncio.gather(*slow))) == 12
    grammars.close()


async def test_retitled_copies_of_one_schema_share_one_compile():
    fake = HeldCompiler()
    grammars = cache(fake, max_compile_s=600)
    copies = [asyncio.create_task(grammars.compile_async(schema(1, title=f"v{i}"), "a"))
              for i in range(12)]
    await settle()
    fake.gate.set()
    assert len(set(await asyncio.gather(*copies))) == 1 and len(fake.started) == 1
    grammars.close()


async def test_a_compile_past_its_bound_is_refused_and_so_is_every_copy_after_it():
    fake = HeldCompiler()
    grammars = cache(fake, max_compile_s=0.05)
    with pytest.raises(InvalidArgument, match="compiling took more than 0.05 s") as err:
        await grammars.compile_async(schema(1, title="first"), "a")
    assert err.value.field == "response_format.json_schema.schema"
    with pytest.raises(InvalidArgument, match="refused on this replica"):
        await grammars.compile_async(schema(1, title="second"), "a")  # no thread, no wait
    with pytest.raises(InvalidArgument, match="refused on this replica"):
        grammars.compile(schema(1, title="third"))
    assert len(fake.started) == 1
    fake.gate.set()
    grammars.close()


async def test_a_tenants_queue_is_bounded_and_the_refusal_is_retryable():
    fake = HeldCompiler()
    grammars = cache(fake, threads=2, tenant_compiles=1, max_queued=2, max_compile_s=600)
    held = [asyncio.create_task(grammars.compile_async(schema(1, minProperties=i), "a"))
            for i in range(3)]  # one runs, two wait
    await settle()
    with pytest.raises(ResourceExhausted, match="tenant 'a' has 1 structured-output compiles "
                                                "running and 2 waiting") as err:
        await grammars.compile_async(schema(1, minProperties=9), "a")
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await grammars.compile_async(schema(30), "b") == ("compiled", schema(30).canonical_spec)
    fake.gate.set()
    await asyncio.gather(*held)
    grammars.close()


async def test_a_compile_that_finds_no_thread_in_time_leaves_the_queue():
    """One thread, held by a: b's compile waits past the bound, is refused RESOURCE_EXHAUSTED
    and is taken out of the queue (it never runs)."""
    fake = HeldCompiler()
    grammars = cache(fake, threads=1, tenant_compiles=1, max_compile_s=0.05)
    slow = asyncio.create_task(grammars.compile_async(schema(1), "a"))
    await settle()
    with pytest.raises(ResourceExhausted, match="no structured-output compile thread"):
        await grammars.compile_async(schema(40), "b")
    assert grammars._queue.waiting("b") == 0
    with pytest.raises(InvalidArgument):
        await slow
    fake.gate.set()
    grammars.close()
    assert schema(40).canonical_spec not in fake.started
