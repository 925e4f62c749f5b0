"""The router's in-memory mirror of the prefix index against a real private redis-server: it
converges to what Redis holds whatever it joins in the middle of, resnapshots on a gap or a new
log, answers without touching Redis, and hands lookups back to Redis when it cannot follow.

(The index semantics themselves — epochs, liveness, eviction, deregistration — run on the mirror
too, as the ``mirror`` backend of test_index_redis.py.)
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis

from kvfleet.deploy.redis_server import start_redis
from kvfleet.index_keys import IndexKeys, ReplicaInfo
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.prefix_index import IndexUnavailable, RedisPrefixIndex
from kvfleet.worker.replica.kv_publisher import KvPublisher


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


CHAIN = [h(i) for i in range(8)]


class Env:
    def __init__(self, url: str, namespace: str):
        self.url, self.namespace = url, namespace
        self.keys = IndexKeys(namespace)
        self.closers: list = []

    def publisher(self, rid: str, **kw) -> KvPublisher:
        pub = KvPublisher(self.url, ReplicaInfo(rid, f"127.0.0.1:{7000 + len(rid)}", "tiny", 0, 16),
                          namespace=self.namespace, **kw)
        self.closers.append(pub)
        return pub

    def mirror(self, **kw) -> MirroredPrefixIndex:
        m = MirroredPrefixIndex(RedisPrefixIndex(self.url, namespace=self.namespace), self.url,
                                namespace=self.namespace, **kw)
        m.start()
        self.closers.append(m)
        return m

    def redis_held(self, r: redis.Redis) -> dict[str, set[bytes]]:
        """Each registered replica's held set as Redis has it (current epoch only)."""
        out = {}
        for rid in r.hkeys(self.keys.registry):
            epoch = r.hget(self.keys.epochs, rid)
            out[rid.decode()] = {k for k, e in r.hgetall(self.keys.held(rid.decode())).items()
                                 if e == epoch and len(k) == 16}
        return out


@pytest.fixture
async def env(redis_server, redis_namespace):
    e = Env(redis_server.url, redis_namespace)
    yield e
    for c in e.closers:
        await c.close()


@pytest.fixture
def raw_redis(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


async def synced(m: MirroredPrefixIndex) -> MirroredPrefixIndex:
    await m.sync()
    await m.replicas()
    assert m.local
    return m


async def test_joins_mid_stream_and_converges_to_redis(env, raw_redis):
    """Three replicas publish random stores/removals (one re-registers midway) while a mirror
    snapshots and replays: it ends holding exactly what Redis holds, and answers the same."""
    rng = random.Random(7)
    pubs = [env.publisher(rid) for rid in ("a", "b", "c")]
    for p in pubs:
        await p.register()
    universe = [h(i) for i in range(64)]

    async def churn(steps: int) -> None:
        for _ in range(steps):
            p = rng.choice(pubs)
            stored = rng.sample(universe, rng.randint(0, 6))
            removed = rng.sample(sorted(p.held), min(len(p.held), rng.randint(0, 4)))
            await p.publish(stored, removed)

    await churn(40)
    mirrors = [env.mirror()]
    # Another mirror joins while writes go on, and a replica re-registers (new epoch) meanwhile.
    churner = asyncio.create_task(churn(120))
    await asyncio.sleep(0)
    mirrors.append(env.mirror())
    await pubs[1].register()
    await churner
    expected = env.redis_held(raw_redis)
    assert sum(len(s) for s in expected.values()) > 20
    ix = RedisPrefixIndex(env.url, namespace=env.namespace)
    env.closers.append(ix)
    for m in mirrors:
        await synced(m)
        assert {rid: held for rid, (_, held) in m._held.items()} == expected
        for start in range(0, 60, 5):
            chain = universe[start:start + 8]
            assert await m.match(chain) == await ix.match(chain)


async def test_a_lookup_from_the_mirror_sends_nothing_to_redis(env, raw_redis):
    pub = env.publisher("a")
    await pub.register()
    await pub.publish(CHAIN[:6], [])
    m = await synced(env.mirror())
    before = int(raw_redis.info("stats")["total_commands_processed"])
    for _ in range(20):
        assert await m.match(CHAIN) == {"a": 6}
    # the follower's own reads (a GET + an XREAD per wake-up) are the only traffic, if any
    assert int(raw_redis.info("stats")["total_commands_processed"]) - before <= 4


async def test_a_gap_in_the_log_resnapshots(env, raw_redis):
    pub = env.publisher("a")
    await pub.register()
    await pub.publish(CHAIN[:3], [])
    m = await synced(env.mirror())
    assert m.snapshots == 1
    # Entries the mirror never read (as if trimmed while it was behind): the log skips 5 seqs.
    raw_redis.incrby(env.keys.events_seq, 5)
    await pub.publish(CHAIN[3:5], [CHAIN[0]])
    await synced(m)
    assert m.snapshots == 2
    assert await m.match(CHAIN[1:]) == {"a": 4}


async def test_a_flushed_redis_starts_a_new_log_and_the_mirror_follows_it(env, raw_redis):
    pub = env.publisher("a", retry_interval_s=0.0)
    await pub.register()
    await pub.publish(CHAIN[:4], [])
    m = await synced(env.mirror())
    assert await m.match(CHAIN) == {"a": 4}
    raw_redis.flushall()
    await pub.publish(CHAIN[4:5], [])  # the publisher re-registers (epoch 1 again) and republishes
    await synced(m)
    assert m.snapshots >= 2 and await m.match(CHAIN) == {"a": 5}


async def test_mirror_hands_lookups_to_redis_when_it_cannot_follow():
    server = start_redis()
    env = Env(server.url, "mirror-kill:")
    try:
        pub = env.publisher("a", retry_interval_s=0.0)
        await pub.register()
        await pub.publish(CHAIN[:4], [])
        m = await synced(env.mirror(block_s=0.2, timeout_s=0.2))
        server.stop()
        t0 = time.monotonic()
        while m.local:  # notices within block_s + 2 × timeout_s
            await asyncio.sleep(0.02)
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(IndexUnavailable):  # the Redis fallback's outage signal
            await m.match(CHAIN)
        server = start_redis(port=server.port)  # empty: the publisher re-registers, a new log
        await pub.publish(CHAIN[4:6], [])
        await synced(m)
        assert await m.match(CHAIN) == {"a": 6}
    finally:
        for c in env.closers:
            await c.close()
        server.stop()
