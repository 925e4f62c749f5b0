"""Issue 24 items 3, 4 and 5 on the real engine: a request runs on exactly the adapter revision
its blocks were hashed under; files changed on disk are refused at (re)load; a non-resident
adapter is not starved by steady traffic on the resident ones, and its wait is bounded."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch

from kvfleet.errors import FailedPrecondition, status_of
from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.runner.lora.adapter import WEIGHTS_FILE, check_adapter, read_adapter
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.runner.tp.layout import shard_layout
from tests.unit.worker.engine_harness import collect, prompt, request, run
from tests.unit.worker.lora_harness import (
    MAX_LORA_RANK,
    lora_error,
    make_lora_engine,
    with_adapter,
)


def _one_slot_held_by(model_dir, adapters, holder, limit: int = 200):
    """A one-slot engine serving adapters qv and all, stepped until ``holder`` computed a token
    (its adapter is loaded and holds the slot): ``(engine, recorder, residency, results)``."""
    engine, rec, res = make_lora_engine(model_dir, {n: adapters[n] for n in ("qv", "all")}, max_loras=1)
    results: dict = {}
    engine.add_request(holder)
    for _ in range(limit):
        collect(results, engine.step())
        if engine._seqs[holder.request_id][0].num_computed_tokens > 0:
            return engine, rec, res, results
    raise AssertionError(f"{holder.request_id} never ran")


def test_a_waiting_request_runs_on_the_revision_it_was_hashed_under(tiny_llama_dir, tiny_adapters) -> None:
    """qv@rev1 waits for the only slot; qv@rev2 is registered meanwhile: the waiting request
    still runs rev1's weights (exact against peft with rev1), a new one runs rev2."""
    holder = with_adapter(request(prompt(9, seed=31), max_tokens=6), "all")
    waiter = with_adapter(request(prompt(18, seed=32), max_tokens=3), "qv")
    engine, rec, res, results = _one_slot_held_by(tiny_llama_dir, tiny_adapters, holder)
    engine.add_request(waiter)  # hashed under qv@rev1, waits: the one slot is held
    rev1 = res.spec("qv").revision
    res.register(check_adapter("qv", tiny_adapters["qv2"], engine.executor.config, MAX_LORA_RANK))
    assert res.spec("qv").revision != rev1
    later = with_adapter(request(prompt(18, seed=32), max_tokens=3), "qv")
    results.update(run(engine, {0: [later]}))
    assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
    got = results[(waiter.request_id, 0)]
    assert lora_error(tiny_llama_dir, tiny_adapters["qv"], rec, waiter, got) <= 1
    new = results[(later.request_id, 0)]
    assert new.last.usage.cached_prompt_tokens == 0  # rev2 never reuses rev1's blocks
    assert lora_error(tiny_llama_dir, tiny_adapters["qv2"], rec, later, new) <= 1
    res.close()


def test_adapter_files_changed_on_disk_are_refused_at_reload(tiny_llama_dir, tiny_adapters, tmp_path) -> None:
    """qv's weights are overwritten in place after registration; once its slot was reused,
    the next qv request is refused FAILED_PRECONDITION naming the file (never the new weights
    under the old revision's block hashes); loading it again serves the new files."""
    qv = tmp_path / "qv"
    shutil.copytree(tiny_adapters["qv"], qv)
    engine, rec, res = make_lora_engine(tiny_llama_dir, {"qv": qv, "all": tiny_adapters["all"]},
                                        max_loras=1)
    shared = prompt(18, seed=41)
    first = with_adapter(request(shared, max_tokens=2), "qv")
    assert run(engine, [first])[(first.request_id, 0)].finish_reason is FinishReason.LENGTH
    shutil.copyfile(tiny_adapters["qv2"] / WEIGHTS_FILE, qv / WEIGHTS_FILE)
    other = with_adapter(request(prompt(9, seed=42), max_tokens=2), "all")  # evicts qv
    run(engine, [other])
    again = with_adapter(request(shared, max_tokens=2), "qv")
    out = run(engine, [again])[(again.request_id, 0)]
    assert out.finish_reason is FinishReason.ERROR
    code, message = status_of(out.last.error)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert str(qv / WEIGHTS_FILE) in message and "changed on disk" in message
    res.register(check_adapter("qv", qv, engine.executor.config, MAX_LORA_RANK))  # load it again
    fresh = with_adapter(request(shared, max_tokens=2), "qv")
    got = run(engine, [fresh])[(fresh.request_id, 0)]
    assert got.last.usage.cached_prompt_tokens == 0
    assert lora_error(tiny_llama_dir, tiny_adapters["qv2"], rec, fresh, got) <= 1
    res.close()


STEADY_STEPS = 30


def test_steady_traffic_on_resident_adapters_does_not_starve_another(tiny_llama_dir, tiny_adapters) -> None:
    """Two slots, a new request for each of qv and all at every step (their slots are never
    unreferenced): a request for rs still runs, exactly, while that traffic goes on."""
    engine, rec, res = make_lora_engine(tiny_llama_dir, {n: tiny_adapters[n] for n in ("qv", "all", "rs")},
                                        max_loras=2)
    starved = with_adapter(request(prompt(10, seed=51), max_tokens=2), "rs")
    arrivals = {k: [with_adapter(request(prompt(5, seed=100 + k), max_tokens=3), "qv"),
                    with_adapter(request(prompt(5, seed=200 + k), max_tokens=3), "all")]
                for k in range(STEADY_STEPS)}
    arrivals[4].append(starved)
    live_at_end = []
    results = run(engine, arrivals, on_step=lambda k, e: k == STEADY_STEPS - 1 and live_at_end.append(
        e.is_active(starved.request_id)))
    assert live_at_end == [False], "rs waited until the steady traffic stopped"
    got = results[(starved.request_id, 0)]
    assert got.finish_reason is FinishReason.LENGTH
    assert lora_error(tiny_llama_dir, tiny_adapters["rs"], rec, starved, got) <= 1
    assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
    res.close()


def test_a_wait_for_an_adapter_slot_is_bounded(tiny_llama_dir, tiny_adapters) -> None:
    """Past the residency's ``max_wait_s`` a waiting request ends RESOURCE_EXHAUSTED naming
    its adapter and the bound."""
    holder = with_adapter(request(prompt(9, seed=61), max_tokens=8), "all")
    waiter = with_adapter(request(prompt(9, seed=62), max_tokens=2), "qv")
    engine, _, res, results = _one_slot_held_by(tiny_llama_dir, tiny_adapters, holder)
    res.max_wait_s = 1e-6  # (after the holder's own wait for its load)
    results.update(run(engine, {0: [waiter]}))
    got = results[(waiter.request_id, 0)]
    assert got.finish_reason is FinishReason.ERROR
    code, message = status_of(got.last.error)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "'qv'" in message and "adapter slots" in message
    assert results[(holder.request_id, 0)].finish_reason is FinishReason.LENGTH
    res.close()


def test_every_tensor_parallel_rank_verifies_the_files_it_reads(tiny_llama_dir, tiny_adapters, tmp_path) -> None:
    """Rank 1 of 2 reads its share only after checking the files are the registered
    revision: a file changed after rank 0's load is refused there too."""
    qv = tmp_path / "qv"
    shutil.copytree(tiny_adapters["qv"], qv)
    config = load_model_config(tiny_llama_dir)
    spec = check_adapter("qv", qv, config, MAX_LORA_RANK)
    layout = shard_layout(config, 2, 1)
    assert read_adapter(spec, config, shard_layout(config, 2, 0), torch.float32, "cpu")
    shutil.copyfile(tiny_adapters["qv2"] / WEIGHTS_FILE, qv / WEIGHTS_FILE)
    with pytest.raises(FailedPrecondition, match="adapter_model.safetensors changed on disk"):
        read_adapter(spec, config, layout, torch.float32, "cpu")
