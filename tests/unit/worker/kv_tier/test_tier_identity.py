"""Whose blocks a node tier holds, and for how long: a block is keyed by the layout of the rank
that wrote it (another tp's rank holds other KV heads, with replicated heads of the same
shape), each deployment (Redis namespace) has its own tier actor on a node, the latest
replica's settings apply, the Redis password never rides in the actor's creation arguments,
a dead actor is found again, and a deployment's stop removes its tiers."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvfleet.secrets import REDIS_PASSWORD_ENV
from kvfleet.worker.kv_tier.node_tier import (
    NodeTierActor,
    TierIndex,
    node_tier,
    node_tiers,
    remove_node_tiers,
)
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.kv_tier.tier_layout import LayoutTier, TierLayout

HASHES = [b"h%015d" % i for i in range(3)]
CAPACITY = 1 << 20


def _run(value: int) -> np.ndarray:
    return np.full((len(HASHES), 64), value, dtype=np.uint8)


def test_a_rank_finds_only_blocks_its_own_layout_wrote():
    store = HostTierStore(CAPACITY)
    # Two KV heads: tp=2 splits them (rank 1: head 1); tp=4 replicates them (rank 1: head 0).
    tp2, tp4 = LayoutTier(store, TierLayout(2, 1)), LayoutTier(store, TierLayout(4, 1))
    for rank in (0, 1):
        tp4.put(rank, HASHES, _run(10 + rank))
    assert tp2.lookup(HASHES, [0, 1]) == 0 and tp2.get(1, HASHES) is None  # never the other's
    assert tp4.lookup(HASHES, [0, 1]) == 3 and tp4.get(1, HASHES).max() == 11
    tp2.put(1, HASHES, _run(21))
    assert tp4.get(1, HASHES).max() == 11 and tp2.get(1, HASHES).max() == 21
    assert tp2.hottest(b"", [0, 1], 8) == [] and len(tp4.hottest(b"", [0, 1], 8)) == 3
    assert sorted(store.held_hashes()) == HASHES  # rank 0's blocks are what the index shows
    store.check_invariants()


def test_a_layer_group_layouts_pages_stay_its_own():
    """A replica with layer groups (pages of one group's layers, each group's under its own
    key) and one without share a node tier: neither finds the other's pages, ``held`` answers
    each page, and only chain hashes of rank 0 reach the index."""
    from kvfleet.allocator.kv_cache_manager import group_key

    store = HostTierStore(CAPACITY)
    grouped = LayoutTier(store, TierLayout(1, 1, "full:2,5|w7:0,1|w7:3,4"))
    flat = LayoutTier(store, TierLayout(1, 1))
    pages = [group_key(1, h) for h in HASHES[:2]]
    grouped.put(0, HASHES, _run(1))
    grouped.put(0, pages, _run(2)[:2])
    assert flat.lookup(HASHES, [0]) == 0 and flat.get(0, HASHES) is None
    assert grouped.held(HASHES + [group_key(1, HASHES[2])] + pages, [0]) == [True] * 3 + [
        False, True, True]
    assert flat.held(HASHES, [0]) == [False] * 3
    assert sorted(store.held_hashes()) == HASHES  # a group's page key is never shown
    store.check_invariants()


def test_the_actor_reads_the_redis_password_from_its_environment(monkeypatch):
    index = TierIndex.of("redis://:s3cret@127.0.0.1:1/0", "kvtest-pw:")
    assert "s3cret" not in repr(index)  # what the actor is created with
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "s3cret")
    actor = NodeTierActor(CAPACITY, "tier:node", index)
    try:
        assert actor.publisher is not None
        assert actor.publisher._redis.connection_pool.connection_kwargs["password"] == "s3cret"
    finally:
        actor.publisher.close()
    with pytest.raises(ValueError, match="must not hold the Redis password"):
        node_tier(CAPACITY, index=dataclasses.replace(index, redis_url="redis://:x@h:1/0"))


@pytest.fixture
def namespaces(ray_session):
    names = ("kvtest-tier-a:", "kvtest-tier-b:")
    yield names
    for ns in names:
        remove_node_tiers(ns)


def test_each_deployment_has_its_own_tier_and_its_stop_removes_it(namespaces):
    a_ns, b_ns = namespaces
    a, b = node_tier(CAPACITY, namespace=a_ns), node_tier(CAPACITY, namespace=b_ns)
    a.put(0, HASHES, _run(1))
    assert a.lookup(HASHES, [0]) == 3 and b.lookup(HASHES, [0]) == 0  # no shared KV
    assert a.held(HASHES[::-1], [0]) == [True] * 3 and b.held(HASHES, [0]) == [False] * 3
    assert {(r["namespace"], r["blocks"]) for r in node_tiers()} >= {(a_ns, 3), (b_ns, 0)}
    assert remove_node_tiers(a_ns) == 1
    assert {r["namespace"] for r in node_tiers()} & set(namespaces) == {b_ns}


def _kill(ray, actor) -> None:
    """Kill ``actor`` and return once a call finds it dead (``ray.kill`` returns before the
    actor is gone, so a call made right after it may still be served)."""
    ray.kill(actor, no_restart=True)
    for _ in range(600):
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed tier actor kept answering")


def test_the_latest_replica_sets_the_capacity_and_a_dead_actor_is_found_again(
        ray_session, namespaces):
    ns = namespaces[0]
    first = node_tier(CAPACITY, namespace=ns)
    first.put(0, HASHES, _run(1))
    second = node_tier(CAPACITY // 2, namespace=ns)  # another --kv-host-memory
    assert second.actor._actor_id == first.actor._actor_id
    assert second.stats().capacity_bytes == CAPACITY // 2
    _kill(ray_session, first.actor)
    with pytest.raises(ray_session.exceptions.RayActorError):
        first.lookup(HASHES, [0])  # the call that finds it dead fails (the step recomputes)
    assert first.lookup(HASHES, [0]) == 0  # the next one has the node's new, empty tier
    first.put(0, HASHES, _run(2))
    with pytest.raises(ray_session.exceptions.RayActorError):
        second.lookup(HASHES, [0])  # its handle too was on the dead actor
    assert second.lookup(HASHES, [0]) == 3  # found the same new one
