"""The host tier under tensor parallelism (each rank stores and restores its own KV heads)
and under a LoRA adapter: restored blocks equal recomputation. Isolation: a tenant's evicted
blocks are never restored for another tenant with the same tokens, nor for another revision
of the same adapter."""

from __future__ import annotations

import dataclasses

from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.runner.lora.adapter import check_adapter
from tests.unit.worker.engine_harness import prompt, request
from tests.unit.worker.executor.tp.thread_executor import thread_executor
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    evict_then_ask_again,
    parity_error,
    restored_blocks,
    tier_engine,
)
from tests.unit.worker.lora_harness import IDENTITY, MAX_LORA_RANK, lora_error, lora_runner_for, with_adapter


def test_tp2_each_rank_restores_its_own_shard(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = HostTierStore(TIER_BYTES)
    with thread_executor(tiny_llama_dir, 2, tier=store) as ex:
        engine, rec, tier, _ = tier_engine(tiny_llama_dir, store, executor=ex, tp=2)
        rank1 = ex.group.workers[0].tier
        base = prompt(22, seed=21)
        again = request(base + prompt(2, seed=22), max_tokens=3)
        results = evict_then_ask_again(engine, tier, base, again, flush_ranks=(rank1,))
        assert restored_blocks(rec, again.request_id) == 5
        assert tier.stats.restores == rank1.stats.restores == 5
        assert {r for _, r in store._blocks} == {0, 1}  # one shard per rank, keyed apart
        assert parity_error(tiny_llama_dir, rec, again, results) <= 1
        engine.kv.check_invariants()


def _lora_engine(model_dir, adapters: dict, store: HostTierStore):
    runner = lora_runner_for(model_dir)
    executor = LocalExecutor(runner, RankTier(store, 0, runner.kv_cache))
    catalog = {n: check_adapter(n, d, runner.config, MAX_LORA_RANK) for n, d in adapters.items()}
    residency = AdapterResidency(executor, catalog, 1)
    engine, rec, tier, _ = tier_engine(model_dir, store, executor=executor, adapters=residency,
                                       identity=IDENTITY)
    return engine, rec, tier, residency


def test_under_an_adapter_restored_blocks_equal_recompute(tiny_llama_dir, tiny_adapters) -> None:
    store = HostTierStore(TIER_BYTES)
    engine, rec, tier, residency = _lora_engine(tiny_llama_dir, {"qv": tiny_adapters["qv"]}, store)
    base = prompt(22, seed=23)
    first = with_adapter(request(base, max_tokens=2), "qv")
    again = with_adapter(request(base + prompt(3, seed=24), max_tokens=3), "qv")
    results = evict_then_ask_again(engine, tier, first, again)
    assert restored_blocks(rec, again.request_id) == 5
    assert lora_error(tiny_llama_dir, tiny_adapters["qv"], rec, again,
                      results[(again.request_id, 0)]) <= 1
    residency.close()


def test_another_revision_of_the_adapter_never_restores_the_old_ones_blocks(
        tiny_llama_dir, tiny_adapters) -> None:
    store = HostTierStore(TIER_BYTES)
    engine, rec, tier, residency = _lora_engine(tiny_llama_dir, {"qv": tiny_adapters["qv"]}, store)
    base = prompt(22, seed=25)
    first = with_adapter(request(base, max_tokens=2), "qv")
    again = with_adapter(request(base, max_tokens=3), "qv")

    def new_revision() -> None:
        residency.register(check_adapter("qv", tiny_adapters["qv2"], engine.executor.config,
                                         MAX_LORA_RANK))

    results = evict_then_ask_again(engine, tier, first, again, between=new_revision)
    assert store.stats().blocks >= 5  # rev1's blocks are in the tier
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert restored_blocks(rec, again.request_id) == 0 and tier.stats.restores == 0
    assert lora_error(tiny_llama_dir, tiny_adapters["qv2"], rec, again,
                      results[(again.request_id, 0)]) <= 1
    residency.close()


def test_a_tenants_evicted_blocks_are_never_restored_for_another_tenant(tiny_llama_dir) -> None:
    engine, rec, tier, store = tier_engine(tiny_llama_dir)
    base = prompt(22, seed=26)
    again = dataclasses.replace(request(base, max_tokens=3), tenant="b")
    results = evict_then_ask_again(engine, tier, base, again, first_tenant="a")
    assert store.stats().blocks >= 5  # tenant a's blocks are in the tier
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert restored_blocks(rec, again.request_id) == 0 and tier.stats.restores == 0
    # Tenant a itself still gets them back.
    mine = dataclasses.replace(request(base, max_tokens=3), tenant="a")
    from tests.unit.worker.engine_harness import run
    got = run(engine, [mine])
    assert got[(mine.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert parity_error(tiny_llama_dir, rec, mine, got) <= 1
