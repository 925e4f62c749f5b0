"""Issue 26 §1: the host tier's metrics (write-backs, restores, dropped write-backs, bytes,
hits by tier) exported from a real engine whose prompt was evicted to the tier and restored;
the node tier's residency in the in-memory index follows the same run."""

from __future__ import annotations

import asyncio

from kvfleet.index_keys import tier_id
from kvfleet.router.prefix_index import InMemoryPrefixIndex
from kvfleet.telemetry import names as n
from kvfleet.telemetry.worker_spans import WorkerTelemetry
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    chain_of,
    evict_then_ask_again,
    restored_blocks,
    tier_engine,
)


def by_tier(capture, metric: str) -> dict[str, float]:
    return {p.attributes[n.KVFLEET_KV_TIER]: p.value for p in capture.points(metric)}


def value(capture, metric: str) -> float:
    (point,) = capture.points(metric)
    return point.value


def test_tier_metrics_follow_a_write_back_and_a_restore(tiny_llama_dir, worker_capture) -> None:
    index = InMemoryPrefixIndex()
    store = HostTierStore(TIER_BYTES, listener=index.tier_publisher(tier_id("n1")).record)
    engine, rec, tier, _ = tier_engine(tiny_llama_dir, store)
    WorkerTelemetry(worker_capture.telemetry, "r1", "tiny", stats_fn=engine.stats)
    base = prompt(22, seed=31)
    again = request(base + prompt(2, seed=32), max_tokens=2)
    evict_then_ask_again(engine, tier, base, again)
    engine.scheduler.tier.lookup.refresh_node_stats()  # what the replica's heartbeat does

    restored = restored_blocks(rec, again.request_id)
    assert restored == 5
    assert value(worker_capture, n.METRIC_TIER_RESTORES) == tier.stats.restores == restored
    assert value(worker_capture, n.METRIC_TIER_WRITE_BACKS) == tier.stats.write_backs > 0
    assert value(worker_capture, n.METRIC_TIER_DROPPED_WRITE_BACKS) == 0
    assert value(worker_capture, n.METRIC_TIER_BYTES_RESTORED) == tier.stats.bytes_restored > 0
    assert value(worker_capture, n.METRIC_TIER_BYTES_USED) == store.stats().bytes_used > 0
    assert value(worker_capture, n.METRIC_TIER_CAPACITY) == TIER_BYTES

    hits = by_tier(worker_capture, n.METRIC_PREFIX_HIT_TOKENS_BY_TIER)
    assert hits["host"] == restored * BLOCK_SIZE
    prompts = engine.stats()["prefix_hits"]["prompt_tokens"]
    rates = by_tier(worker_capture, n.METRIC_PREFIX_HIT_RATE_BY_TIER)
    assert rates["host"] == hits["host"] / prompts and rates["device"] == hits["device"] / prompts

    # The node tier's residency in the index: the restored prompt's blocks are there
    chain = chain_of(engine, again)[:restored]
    got = asyncio.run(index.host_match(chain, {"r1": (tier_id("n1"), 0)}))
    assert got == {"r1": restored}


def test_a_replica_without_a_tier_reports_device_hits_only(tiny_llama_dir, worker_capture) -> None:
    from tests.unit.worker.engine_harness import make_engine, run

    engine, _ = make_engine(tiny_llama_dir)
    WorkerTelemetry(worker_capture.telemetry, "r1", "tiny", stats_fn=engine.stats)
    base = prompt(40, seed=33)
    run(engine, [request(base, max_tokens=1)])
    run(engine, [request(base, max_tokens=1)])
    assert by_tier(worker_capture, n.METRIC_PREFIX_HIT_TOKENS_BY_TIER) == {
        "device": (len(base) - 1) // BLOCK_SIZE * BLOCK_SIZE, "host": 0}  # the reuse rule
    assert worker_capture.points(n.METRIC_TIER_RESTORES) == []
