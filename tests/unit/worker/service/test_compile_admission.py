"""Structured-output compiles at the worker's edge: a request is admitted (its reservation
taken) before its schema compiles, so one the replica refuses costs no compile; and, through
the real engine on its thread, tenant b's schema compiles and its request streams valid JSON
while tenant a's compiles hold their thread."""

from __future__ import annotations

import asyncio
import json
import threading
import types

import grpc
import jsonschema

from kvfleet.constraint import Constraint, GrammarConfig
from kvfleet.v1 import worker_pb2
from kvfleet.worker.engine.output.grammar import GrammarCache
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import ZERO
from kvfleet.worker.service.engine_loop import EngineLoop
from kvfleet.worker.service.server import WorkerService
from tests.unit.worker.engine_harness import make_engine, prompt

PAIR = {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}


def frame(call_id: int, tenant: str, doc: dict, max_tokens: int = 40
          ) -> worker_pb2.GenerateStreamRequest:
    f = worker_pb2.GenerateStreamRequest(call_id=call_id)
    g = f.generate
    g.request_id, g.tenant = f"{tenant}{call_id}", tenant
    g.prompt_token_ids.extend(prompt(6, seed=call_id))
    g.sampling.max_tokens = max_tokens
    g.json_schema = json.dumps(doc)
    return f


def slow_schema(i: int) -> dict:
    return {"type": "object", "required": ["slow"], "additionalProperties": False,
            "properties": {"slow": {"type": "integer", "minimum": 0, "maximum": i}}}


class Held:
    """A compile: schemas with a ``slow`` property wait for :attr:`gate`; every one is counted,
    and the others are compiled by ``real`` (None: a stand-in value)."""

    def __init__(self, real: GrammarCache | None = None) -> None:
        self.gate = threading.Event()
        self.calls: list[str] = []
        self.real = real

    def __call__(self, c: Constraint):
        self.calls.append(c.canonical_spec)
        if '"slow"' in c.canonical_spec:
            self.gate.wait()
        return self.real.compile(c) if self.real is not None else object()


class IdleLoop:
    """An engine loop whose requests never finish (they hold their reservation)."""

    def __init__(self, grammars: GrammarCache, config: SchedulerConfig) -> None:
        self.engine = types.SimpleNamespace(scheduler=types.SimpleNamespace(config=config),
                                            step_cost=ZERO, grammars=grammars)
        self.stats = {"running": 0, "waiting": 0}
        self.never = asyncio.Event()

    async def generate(self, req):
        await self.never.wait()
        yield  # an async generator, as EngineLoop.generate


async def test_a_request_the_replica_refuses_never_compiles():
    """One sequence of room: the second request is refused RESOURCE_EXHAUSTED by the arrival
    count, and its schema is never compiled (nor queued)."""
    compiles = Held()
    grammars = GrammarCache(None, 64, [0], compiler=compiles)  # type: ignore[arg-type]
    loop = IdleLoop(grammars, SchedulerConfig(max_num_seqs=1, max_waiting=0))
    service = WorkerService(loop, "rep-c", "m", 16)  # type: ignore[arg-type]
    out: asyncio.Queue = asyncio.Queue()
    first = asyncio.create_task(service._stream_call(frame(1, "a", PAIR), out))
    while service.reservations.count == 0:
        await asyncio.sleep(0)
    await service._stream_call(frame(2, "a", {**PAIR, "minProperties": 1}), out)
    done = out.get_nowait()
    assert done.call_id == 2 and done.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    while not compiles.calls:  # the first request's compile, on a compile thread
        await asyncio.sleep(0.001)
    assert len(compiles.calls) == 1, "the refused request's schema was compiled"
    first.cancel()
    grammars.close()


async def test_tenant_b_streams_valid_json_while_tenant_a_compiles_hold_their_thread(tiny_llama_dir):
    engine, _ = make_engine(tiny_llama_dir)
    real = GrammarCache(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    compiles = Held(real)
    engine.grammars = GrammarCache(engine.tokenizer, engine.vocab_size,
                                   sorted(engine.eos_token_ids),
                                   GrammarConfig(threads=2, tenant_compiles=1), compiler=compiles)
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    try:
        service = WorkerService(loop, "rep-s", "m", 4)
        a_out: asyncio.Queue = asyncio.Queue()
        a_calls = [asyncio.create_task(service._stream_call(frame(10 + i, "a", slow_schema(i)),
                                                            a_out)) for i in range(4)]
        while not compiles.calls:  # a's first compile holds a thread
            await asyncio.sleep(0.001)
        b_out: asyncio.Queue = asyncio.Queue()
        await service._stream_call(frame(1, "b", PAIR), b_out)
        frames = [b_out.get_nowait() for _ in range(b_out.qsize())]
        assert frames[-1].done and frames[-1].status_code == grpc.StatusCode.OK.value[0], frames[-1]
        text = "".join(f.message.text for f in frames if f.HasField("message"))
        jsonschema.validate(json.loads(text), PAIR)
        assert not any(c.done() for c in a_calls)  # a's compiles still held
        assert len(compiles.calls) == 2  # a's first and b's: a's others wait their turn
        compiles.gate.set()
        await asyncio.gather(*a_calls)
        a_done = [f for f in (a_out.get_nowait() for _ in range(a_out.qsize())) if f.done]
        assert len(a_done) == 4 and all(f.status_code == 0 for f in a_done)
    finally:
        compiles.gate.set()
        loop.stop()
        engine.grammars.close()
        real.close()
