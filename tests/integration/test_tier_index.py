"""Issue 26 §1 against a real private redis-server: a node tier's publisher writes its store's
residency (write-backs and LRU evictions, in order) to the index and the event log; the
router's mirror and the Redis lookup agree on it; a restarted tier starts empty and
republishes; and the router's core, reading through the mirror, prefers the replica whose
node tier holds the prefix over a cold one."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from kvfleet.index_keys import IndexKeys, ReplicaInfo, ReplicaLoad, tier_id
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.prefix_index import RedisPrefixIndex
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.kv_tier.tier_publisher import TierPublisher
from kvfleet.worker.replica.kv_publisher import KvPublisher
from tests.unit.router.test_tier_credit import route_with_tiers

BLOCK = np.zeros((1, 8), dtype=np.uint8)
TIER = tier_id("node-b")


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


CHAIN = [h(i) for i in range(8)]


class TierEnv:
    """A tier store of ``capacity_blocks`` blocks publishing to Redis, plus the router's two
    readers (the mirror, and Redis itself)."""

    def __init__(self, url: str, namespace: str, capacity_blocks: int = 6) -> None:
        self.url, self.namespace = url, namespace
        self.store = HostTierStore(capacity_blocks * BLOCK.nbytes)
        self.publisher = self.tier_publisher()
        self.redis_index = RedisPrefixIndex(url, namespace=namespace)
        self.mirror = MirroredPrefixIndex(RedisPrefixIndex(url, namespace=namespace), url,
                                          namespace=namespace)
        self.closers: list = [self.redis_index, self.mirror]

    def tier_publisher(self) -> TierPublisher:
        pub = TierPublisher(self.url, TIER, self.store.held_hashes, self.namespace)
        self.store.listener = pub.record
        return pub

    def put(self, hashes: list[bytes], rank: int = 0) -> None:
        self.store.put(rank, hashes, np.repeat(BLOCK, len(hashes), axis=0))
        self.publisher.flush()

    async def host(self, starts: dict[str, int]) -> dict[str, int]:
        """``host_match`` from Redis, checked equal to the mirror's once it has caught up."""
        wanted = {rid: (TIER, start) for rid, start in starts.items()}
        from_redis = await self.redis_index.host_match(CHAIN, wanted)
        await self.mirror.sync()
        assert self.mirror.local
        assert await self.mirror.host_match(CHAIN, wanted) == from_redis
        return from_redis


@pytest.fixture
async def tenv(redis_server, redis_namespace):
    e = TierEnv(redis_server.url, redis_namespace)
    e.mirror.start()
    yield e
    e.publisher.close()
    for c in e.closers:
        await c.close()


async def test_write_backs_and_evictions_reach_redis_and_the_mirror(tenv):
    tenv.put(CHAIN[:4])
    assert await tenv.host({"a": 0, "b": 2, "c": 4}) == {"a": 4, "b": 2}
    tenv.put(CHAIN[4:6], rank=1)  # other ranks' shards are stored, not shown
    assert await tenv.host({"a": 0}) == {"a": 4}
    tenv.put(CHAIN[4:6])  # 8 shards for 6 slots: the two oldest (rank 0's h0, h1) go
    assert tenv.store.held_hashes() == CHAIN[2:6]
    assert await tenv.host({"a": 0, "b": 2}) == {"b": 4}
    r = redis.Redis.from_url(tenv.url)
    held = {k for k in r.hkeys(IndexKeys(tenv.namespace).tier_held(TIER)) if len(k) == 16}
    assert held == set(CHAIN[2:6]) and 0 < r.pttl(IndexKeys(tenv.namespace).tier_held(TIER))
    r.close()


async def test_a_restarted_tier_starts_empty_and_republishes(tenv):
    tenv.put(CHAIN[:3])
    assert await tenv.host({"a": 0}) == {"a": 3}
    first_epoch = tenv.publisher.epoch
    tenv.publisher.close()
    tenv.store.clear()  # a new actor: an empty store, a new publisher (next epoch)
    tenv.publisher = tenv.tier_publisher()
    tenv.put(CHAIN[1:2])
    assert tenv.publisher.epoch == first_epoch + 1
    assert await tenv.host({"a": 0, "b": 1}) == {"b": 1}
    # Redis loses everything: the next pass registers again and republishes the store
    r = redis.Redis.from_url(tenv.url)
    for key in r.scan_iter(match=f"{tenv.namespace}*"):
        r.delete(key)
    r.close()
    tenv.put(CHAIN[2:3])
    assert await tenv.host({"b": 1}) == {"b": 2}


async def test_the_router_prefers_the_replica_whose_node_tier_holds_the_prefix(tenv):
    load = ReplicaLoad(0, 0, 64, 64, 1.7e9, 0.0, 0.001)
    pubs = []
    for rid, tier in (("cold", tier_id("node-a")), ("warm", TIER)):
        pub = KvPublisher(tenv.url, ReplicaInfo(rid, f"127.0.0.1:{len(rid)}", "m", 0, 16,
                                                kv_tier=tier), namespace=tenv.namespace)
        await pub.register()
        await pub.heartbeat(load)
        pubs.append(pub)
    families = [[bytes([f]) * 8 + h(i)[8:] for i in range(3)] for f in range(2)]
    for chain in families:
        tenv.put(chain)
    await tenv.mirror.sync()
    try:
        assert await route_with_tiers(tenv.mirror, "prefix_aware", families) == ["warm", "warm"]
        assert await route_with_tiers(tenv.mirror.fallback, "prefix_aware",  # one round trip
                                      families) == ["warm", "warm"]
    finally:
        for pub in pubs:
            await pub.deregister()
            await pub.close()


def test_an_unreachable_index_never_raises_into_the_tier(caplog):
    store = HostTierStore(4 * BLOCK.nbytes)
    pub = TierPublisher("redis://127.0.0.1:1", TIER, store.held_hashes, timeout_s=0.2,
                        retry_interval_s=0.0)
    store.listener = pub.record
    try:
        with caplog.at_level("WARNING", logger="kvfleet.worker.kv_tier.tier_publisher"):
            for i in range(3):
                store.put(0, [h(i)], BLOCK)
                pub.flush()
        assert pub.epoch == 0 and store.held_hashes() == [h(0), h(1), h(2)]
        assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
    finally:
        pub.close()


async def test_a_stopped_tiers_entries_leave_the_mirror_when_they_expire(tenv):
    """A tier that stops (its actor gone, no more heartbeats): its entries expire in Redis,
    and the mirror drops its copy at its next registry read instead of crediting (and
    holding) them for ever."""
    tenv.put(CHAIN[:3])
    await tenv.mirror.replicas()  # a live tier's entries stay
    assert await tenv.host({"a": 0}) == {"a": 3}
    tenv.publisher.close()
    r = redis.Redis.from_url(tenv.url)
    r.delete(IndexKeys(tenv.namespace).tier_held(TIER))  # its TTL ran out
    r.close()
    await tenv.mirror.replicas()
    assert await tenv.host({"a": 0}) == {}


async def test_a_pass_with_thousands_of_changes_is_written_without_a_resync(redis_server,
                                                                           redis_namespace):
    """More changes in one pass than a Lua ``unpack`` takes (about 8,000 values) go in
    batches: no script error, so no new epoch and no republish of the whole tier."""
    env = TierEnv(redis_server.url, redis_namespace, capacity_blocks=6000)
    many = [h(i) for i in range(100, 5100)]
    try:
        env.put(many[:1])
        epoch = env.publisher.epoch
        env.put(many)
        assert env.publisher.epoch == epoch
        from_redis = await env.redis_index.host_match(many, {"a": (TIER, 0)})
        assert from_redis == {"a": len(many)}
    finally:
        env.publisher.close()
        for c in env.closers:
            await c.close()


def test_changes_during_an_outage_are_not_kept():
    """While the index is down the publisher keeps no changes (the resync after it
    republishes the store), so a long outage does not grow the tier actor's memory."""
    store = HostTierStore(4 * BLOCK.nbytes)
    pub = TierPublisher("redis://127.0.0.1:1", TIER, store.held_hashes, timeout_s=0.2,
                        retry_interval_s=60.0)
    store.listener = pub.record
    try:
        pub.flush()  # fails: down, backing off
        for i in range(1000):
            store.put(0, [h(i)], BLOCK)
            pub.flush()  # skipped while backing off
        assert pub.pending == 0 and len(store.held_hashes()) == 4
    finally:
        pub.close()
