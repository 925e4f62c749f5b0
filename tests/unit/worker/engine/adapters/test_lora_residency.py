"""Adapter residency: LRU slots loaded on first use off the engine thread; a request waits
(never fails) while its adapter loads; an adapter in use is never evicted; block hashes depend
on the adapter's name and revision only, never on the slot or the load order."""

from __future__ import annotations

import threading

import pytest

from kvfleet.allocator.hashing import block_hash_chain
from kvfleet.errors import FailedPrecondition, NotFound
from kvfleet.router.served_model import ServedModel
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.engine.request import FinishReason
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request, run
from tests.unit.worker.lora_harness import (
    IDENTITY,
    lora_error,
    make_lora_engine,
    with_adapter,
)


class FakeRunner:
    """Records loads; ``gate`` (when set) holds every load until it is set; ``fail`` names
    adapters whose load raises."""

    def __init__(self, gate: threading.Event | None = None, fail=()) -> None:
        self.loads: list[tuple[int, str]] = []
        self.gate, self.fail = gate, set(fail)

    def load_adapter(self, slot, spec) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        if spec.name in self.fail:
            raise OSError(f"cannot read {spec.name}")
        self.loads.append((slot, spec.name))

    def unload_adapter(self, slot) -> None:
        pass


class Spec:
    def __init__(self, name: str, revision: str = "r") -> None:
        self.name, self.revision = name, revision


def _resident(res: AdapterResidency, name: str) -> int:
    """Acquire ``name``, waiting for its load."""
    for _ in range(100):
        slot = res.acquire(name)
        if slot is not None:
            return slot
        res.wait(0.1)
    raise AssertionError(f"{name} never loaded")


def test_lru_eviction_never_takes_a_slot_in_use() -> None:
    runner = FakeRunner()
    res = AdapterResidency(runner, {n: Spec(n) for n in "abcd"}, max_loras=2)
    a, b = _resident(res, "a"), _resident(res, "b")
    res.release(b)  # a is still held by a request
    c = _resident(res, "c")
    assert c == b and runner.loads == [(a, "a"), (b, "b"), (b, "c")]
    assert res.acquire("d") is None and len(runner.loads) == 3  # both held: d waits
    res.release(c)
    assert _resident(res, "d") == c and res.resident() == {"a": "r", "d": "r"}
    res.release(a)
    res.release(c)
    assert _resident(res, "a") == a and len(runner.loads) == 4  # resident: no reload
    res.unregister("a")  # its slot stays until reused, but it is no longer reported
    assert res.resident() == {"d": "r"}
    with pytest.raises(NotFound, match="adapter 'a' is not served"):
        res.acquire("a")
    res.close()


def test_a_failed_load_is_reported_to_the_request() -> None:
    res = AdapterResidency(FakeRunner(fail={"bad"}), {"bad": Spec("bad")}, max_loras=1)
    with pytest.raises(FailedPrecondition, match=r"adapter 'bad' \(revision r\) failed to load: cannot read bad"):
        _resident(res, "bad")
    res.close()


def test_request_waits_while_its_adapter_loads_and_in_use_is_never_evicted(
        tiny_llama_dir, tiny_adapters) -> None:
    """One slot, two adapters: the second request waits for the first's adapter to be
    released, then loads its own; both finish exactly."""
    gate = threading.Event()
    engine, rec, res = make_lora_engine(tiny_llama_dir, {n: tiny_adapters[n] for n in ("qv", "all")},
                                        max_loras=1)
    real_load = res.runner.load_adapter
    res.runner = type("Gated", (), {"load_adapter": lambda self, s, spec: (gate.wait(10),
                                                                           real_load(s, spec))})()
    first = with_adapter(request(prompt(9, seed=5), max_tokens=4), "qv")
    second = with_adapter(request(prompt(7, seed=6), max_tokens=3), "all")
    engine.add_request(first)
    engine.add_request(second)
    for _ in range(3):  # loading: nothing runs, nothing fails
        assert engine.step() == [] and engine.has_work
    gate.set()
    results = run(engine, [])
    assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
    first_steps = [i for i, p in enumerate(rec.plans) for c in p.chunks if c.seq_id.startswith(first.request_id)]
    second_steps = [i for i, p in enumerate(rec.plans) for c in p.chunks if c.seq_id.startswith(second.request_id)]
    assert max(first_steps) < min(second_steps), "the slot in use was taken"
    for r, name in ((first, "qv"), (second, "all")):
        assert lora_error(tiny_llama_dir, tiny_adapters[name], rec, r, results[(r.request_id, 0)]) <= 1
    res.close()


def test_block_hashes_depend_on_revision_not_slot_or_load_order(tiny_llama_dir, tiny_adapters) -> None:
    one, _, res_one = make_lora_engine(tiny_llama_dir, {n: tiny_adapters[n] for n in ("all", "qv")})
    two, _, res_two = make_lora_engine(tiny_llama_dir, {"qv": tiny_adapters["qv"]})
    run(one, [with_adapter(request(prompt(5, seed=7), max_tokens=1), "all")])  # "all" takes slot 1
    tokens = prompt(20, seed=8)
    hashes, slots = [], []
    for engine in (one, two):
        req = with_adapter(request(tokens, max_tokens=1), "qv")
        engine.add_request(req)
        seq = engine._seqs[req.request_id][0]
        run(engine, [])
        hashes.append(seq.block_hashes[: len(tokens) // BLOCK_SIZE])
        slots.append(seq.adapter_slot)
    assert slots[0] != slots[1] and hashes[0] == hashes[1]
    # The router derives the same chain from the registered revision.
    served = ServedModel("tiny", tiny_llama_dir, None, None, IDENTITY, 256, 49152, BLOCK_SIZE)
    root = served.root_hash("default", "", ("qv", res_two.spec("qv").revision))
    assert block_hash_chain(root, tokens, BLOCK_SIZE) == hashes[0]
    assert block_hash_chain(served.root_hash("default", ""), tokens, BLOCK_SIZE) != hashes[0]
    res_one.close()
    res_two.close()
