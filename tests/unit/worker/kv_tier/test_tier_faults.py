"""The node tier as a real Ray actor: a restore through the object store equals recompute;
the actor killed mid-transfer leaves the request to complete by recomputation, and nothing
leaks (pool blocks, the rank's queued write-backs, object references, the tier's bytes)."""

from __future__ import annotations

import gc

import pytest

from kvfleet.index_keys import DEFAULT_NAMESPACE
from kvfleet.worker.kv_tier.node_tier import RayTier, node_tier, node_tiers, remove_node_tiers
from kvfleet.worker.kv_tier.tier_layout import LayoutTier, TierLayout
from tests.unit.worker.engine_harness import prompt, request
from tests.unit.worker.kv_tier.tier_harness import (
    chain_of,
    evict_then_ask_again,
    parity_error,
    restored_blocks,
    tier_engine,
)

CAPACITY = 32 << 20


@pytest.fixture
def ray_tier(ray_session):
    yield node_tier(CAPACITY)
    remove_node_tiers(DEFAULT_NAMESPACE)


def _live_refs(ray) -> int:
    """Object references this process holds (after collecting cycles through tracebacks)."""
    gc.collect()
    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


def test_restore_through_the_node_actor_equals_recompute(ray_tier, tiny_llama_dir) -> None:
    engine, rec, tier, _ = tier_engine(tiny_llama_dir, ray_tier)
    base = prompt(22, seed=31)
    again = request(base + prompt(3, seed=32), max_tokens=3)
    results = evict_then_ask_again(engine, tier, base, again)
    assert restored_blocks(rec, again.request_id) == 5
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    assert tier.flush(), "write-backs did not finish"  # the second run's evictions land too
    stats = ray_tier.stats()
    assert stats.blocks >= 5 and stats.bytes_used == stats.blocks * tier.stats.bytes_restored // 5
    assert stats.bytes_used <= CAPACITY
    (row,) = node_tiers()  # what kvfleet status shows
    assert (row["blocks"], row["bytes_used"], row["capacity_bytes"]) == (
        stats.blocks, stats.bytes_used, CAPACITY)


class _KilledMidTransfer:
    """The node tier, whose actor is killed when a restore asks it for a run."""

    def __init__(self, tier: RayTier) -> None:
        self.tier = tier
        self.put, self.lookup = tier.put, tier.lookup

    def get(self, rank, hashes):
        import ray

        ray.kill(self.tier.actor)
        with pytest.raises(ray.exceptions.RayActorError):  # dead before the get reaches it
            for _ in range(200):
                ray.get(self.tier.actor.stats.remote(), timeout=5)
        return self.tier.get(rank, hashes)


def test_actor_killed_mid_transfer_the_request_recomputes_and_nothing_leaks(
        ray_session, ray_tier, tiny_llama_dir) -> None:
    store = _KilledMidTransfer(ray_tier)
    engine, rec, tier, _ = tier_engine(tiny_llama_dir, store)
    refs_before = _live_refs(ray_session)
    base = prompt(22, seed=33)
    again = request(base + prompt(3, seed=34), max_tokens=3)
    chain = chain_of(engine, request(base))
    held_before: list[int] = []  # base's blocks in the tier before the kill (the control)
    results = evict_then_ask_again(
        engine, tier, base, again,
        between=lambda: held_before.append(ray_tier.lookup(chain, [tier.rank])))
    assert held_before == [len(chain)]
    got = results[(again.request_id, 0)]
    assert len(got.token_ids) == 3 and got.last.error is None
    assert got.last.usage.cached_prompt_tokens == 0  # recomputed, not restored
    assert tier.stats.failed_restores == 1 and tier.stats.restores == 0
    assert restored_blocks(rec, again.request_id) == 0  # the plan that ran restores nothing
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    # Nothing leaks: every pool block free again, no write-back queued, no reference held.
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert tier.flush() and tier.pending_bytes == 0
    assert _live_refs(ray_session) <= refs_before
    # The dead actor's bytes went with it: the node's next tier holds none of base's blocks
    # (a write-back queued after the kill may have started that tier afresh).
    assert node_tier(CAPACITY).lookup(chain, [tier.rank]) == 0


def test_a_replica_with_kv_host_memory_uses_its_nodes_tier(ray_session, ray_tier,
                                                           tiny_llama_dir) -> None:
    from kvfleet.worker.replica.replica import build_engine
    from tests.fixtures.cluster import tiny_replica

    cfg = tiny_replica(tiny_llama_dir, "redis://127.0.0.1:1/0", "kvtest-tier:",
                       kv_host_memory_bytes=CAPACITY)
    engine = build_engine(cfg)
    try:
        assert engine.scheduler.tier.enabled and engine.executor.tier.enabled
        store = engine.executor.tier.store  # the deployment's tier, through the layout
        mc = engine.executor.config
        assert isinstance(store, LayoutTier) and isinstance(store.store, RayTier)
        assert store.layout == TierLayout(1, mc.num_kv_heads)
        ns_tier = node_tier(CAPACITY, namespace="kvtest-tier:")
        assert store.store.actor._actor_id == ns_tier.actor._actor_id != ray_tier.actor._actor_id
    finally:
        engine.executor.close()
        remove_node_tiers("kvtest-tier:")
