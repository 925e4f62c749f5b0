"""The prefix index and replica registry against a real private redis-server.

Scenarios taking ``backend`` run three times: on Redis (RedisPrefixIndex + KvPublisher), on the
router's in-memory mirror of it (MirroredPrefixIndex following the KV event log) and on
InMemoryPrefixIndex + its publisher, proving the implementations agree.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import pytest
import redis

from kvfleet.deploy.redis_server import start_redis
from kvfleet.index_keys import IndexKeys, ReplicaInfo, ReplicaLoad
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.prefix_index import IndexUnavailable, InMemoryPrefixIndex, RedisPrefixIndex
from kvfleet.worker.replica.kv_publisher import KvPublisher


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


CHAIN = [h(i) for i in range(8)]
LOAD = ReplicaLoad(running=3, waiting=1, num_free_blocks=40, num_total_blocks=64, updated_at=1.7e9)


def info(rid: str) -> ReplicaInfo:
    return ReplicaInfo(rid, f"127.0.0.1:{6000 + len(rid)}", "tiny", 0, 16)


class SyncedMirror:
    """The router's mirror read as a router reads it: after a registry refresh, once it has
    applied the event log up to now — and always from memory, never the Redis fallback."""

    def __init__(self, mirror: MirroredPrefixIndex):
        self.mirror = mirror

    async def match(self, chain):
        await self.mirror.sync()
        await self.mirror.replicas()
        assert self.mirror.local
        return await self.mirror.match(chain)

    async def replicas(self):
        return await self.mirror.replicas()

    async def close(self):
        await self.mirror.close()


class Backend:
    """Readers and writers over one index; ``expire`` lets ``ttl_s`` seconds pass for liveness."""

    def __init__(self, kind: str, url: str = "", namespace: str = ""):
        self.kind, self.url, self.namespace = kind, url, namespace
        self.now = 0.0
        self.memory = InMemoryPrefixIndex(replica_ttl_s=1.0, clock=lambda: self.now)
        self.closers = []

    def index(self, ttl_s: float = 1.0):
        if self.kind == "memory":
            self.memory.replica_ttl_s = ttl_s
            return self.memory
        ix = RedisPrefixIndex(self.url, namespace=self.namespace, replica_ttl_s=ttl_s)
        if self.kind == "mirror":
            mirror = MirroredPrefixIndex(ix, self.url, namespace=self.namespace)
            mirror.start()
            ix = SyncedMirror(mirror)
        self.closers.append(ix)
        return ix

    def publisher(self, rid: str, **kw):
        if self.kind == "memory":
            return self.memory.publisher(info(rid), replica_ttl_s=kw.get("replica_ttl_s", 10.0))
        pub = KvPublisher(self.url, info(rid), namespace=self.namespace, **kw)
        self.closers.append(pub)
        return pub

    async def start(self, rid: str, blocks: list[bytes], **kw):
        pub = self.publisher(rid, **kw)
        await pub.register()
        await pub.publish(blocks, [])
        return pub

    async def expire(self, ttl_s: float) -> None:
        if self.kind == "memory":
            self.now += ttl_s * 1.5
        else:
            await asyncio.sleep(ttl_s * 1.5)


@pytest.fixture(params=["redis", "mirror", "memory"])
async def backend(request, redis_namespace):
    url = request.getfixturevalue("redis_server").url if request.param != "memory" else ""
    b = Backend(request.param, url, redis_namespace)
    yield b
    for c in b.closers:
        await c.close()


@pytest.fixture
async def redis_backend(redis_server, redis_namespace):
    b = Backend("redis", redis_server.url, redis_namespace)
    yield b
    for c in b.closers:
        await c.close()


@pytest.fixture
def sync_redis(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield r
    r.close()


async def test_leading_match_lengths(backend):
    await backend.start("a", CHAIN[:5])
    await backend.start("b", [CHAIN[0], CHAIN[1], CHAIN[3]])   # 0, 1, 3 → 2
    await backend.start("c", CHAIN[1:])                        # lacks block 0 → absent
    await backend.start("d", CHAIN)
    other = [h(100 + i) for i in range(3)]
    await backend.start("e", other)
    ix = backend.index()
    assert await ix.match(CHAIN) == {"a": 5, "b": 2, "d": 8}
    assert await ix.match(other + CHAIN) == {"e": 3}
    assert await ix.match([]) == {}


async def test_restarted_replica_old_entries_ignored(backend):
    old = await backend.start("a", CHAIN)
    ix = backend.index()
    assert await ix.match(CHAIN) == {"a": 8}
    new = backend.publisher("a")
    await new.register()
    assert new.epoch == old.epoch + 1
    assert await ix.match(CHAIN) == {}
    await new.publish(CHAIN[:3], [])
    await old.publish(CHAIN, [])          # the lingering old process cannot clobber the new one
    await old.heartbeat(LOAD)
    assert await ix.match(CHAIN) == {"a": 3}
    [(got, load)] = await ix.replicas()
    assert got.epoch == new.epoch and load is None


async def test_expired_heartbeat_ignored_until_next_beat(backend):
    pub = await backend.start("a", CHAIN)
    ix = backend.index(ttl_s=0.4)
    assert await ix.match(CHAIN) == {"a": 8}
    await backend.expire(0.4)
    assert await ix.match(CHAIN) == {}
    assert await ix.replicas() == []
    await pub.heartbeat(LOAD)
    assert await ix.match(CHAIN[:2]) == {"a": 2}


async def test_evicted_hashes_removed(backend):
    pub = await backend.start("a", CHAIN)
    ix = backend.index()
    await pub.publish([], [CHAIN[2], CHAIN[6]])
    assert await ix.match(CHAIN) == {"a": 2}
    await pub.publish([CHAIN[2]], [CHAIN[2]])   # removed first, then stored
    assert await ix.match(CHAIN) == {"a": 6}


async def test_registry_load_and_deregister(backend):
    a = await backend.start("a", CHAIN)
    await backend.start("b", CHAIN[:2])
    await a.heartbeat(LOAD)
    ix = backend.index()
    got = {r.replica_id: (r, load) for r, load in await ix.replicas()}
    assert got["a"] == (ReplicaInfo("a", info("a").address, "tiny", a.epoch, 16), LOAD)
    assert got["b"][1] is None
    await a.deregister()
    assert await ix.match(CHAIN) == {"b": 2}
    assert [r.replica_id for r, _ in await ix.replicas()] == ["b"]


async def test_blocks_published_before_register_are_republished(backend):
    pub = backend.publisher("a")
    await pub.publish(CHAIN[:4], [])
    ix = backend.index()
    assert await ix.match(CHAIN) == {}
    await pub.register()
    assert await ix.match(CHAIN) == {"a": 4}


# -- Redis only ------------------------------------------------------------------------------------

def _stat(r: redis.Redis, cmd: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))


async def test_match_is_one_round_trip(redis_backend, sync_redis):
    b = redis_backend
    chain = [h(i) for i in range(64)]
    for i, rid in enumerate("abcd"):
        await b.start(rid, chain[: 16 * (i + 1)])
    ix = b.index()
    assert await ix.match(chain) == {"a": 16, "b": 32, "c": 48, "d": 64}   # warm: script loaded
    sent = []
    inner = ix._redis.execute_command
    async def counting(*args, **kw):
        sent.append(args[0])
        return await inner(*args, **kw)
    ix._redis.execute_command = counting
    before = {c: _stat(sync_redis, c) for c in ("evalsha", "eval", "script|load")}
    assert await ix.match(chain) == {"a": 16, "b": 32, "c": 48, "d": 64}
    after = {c: _stat(sync_redis, c) for c in ("evalsha", "eval", "script|load")}
    assert sent == ["EVALSHA"]
    assert after == {**before, "evalsha": before["evalsha"] + 1}


async def test_stale_members_cleaned_lazily(redis_backend, sync_redis):
    backend = redis_backend
    old = await backend.start("a", CHAIN)
    new = backend.publisher("a", block_ttl_s=30.0)
    await new.register()
    await new.publish(CHAIN[:2], [])
    keys = IndexKeys(backend.namespace)
    assert sync_redis.hgetall(keys.block(CHAIN[5])) == {"a": str(old.epoch)}
    assert await backend.index().match(CHAIN) == {"a": 2}
    assert sync_redis.hgetall(keys.block(CHAIN[0])) == {"a": str(new.epoch)}
    assert sync_redis.hgetall(keys.block(CHAIN[2])) == {}        # visited, stale → deleted
    assert 0 < sync_redis.pttl(keys.block(CHAIN[0])) <= 30_000
    await new.deregister()
    assert sync_redis.exists(keys.block(CHAIN[0]), keys.block(CHAIN[1])) == 0


async def test_registry_read_sweeps_garbage(redis_backend, sync_redis):
    b = redis_backend
    dead = await b.start("dead", CHAIN)
    old = await b.start("a", CHAIN)
    new = await b.start("a", CHAIN[:1])
    alive = await b.start("b", CHAIN)
    keys = IndexKeys(b.namespace)
    assert sync_redis.hgetall(keys.block(CHAIN[4])) == {
        "dead": "1", "a": str(old.epoch), "b": str(alive.epoch)}
    ix = RedisPrefixIndex(b.url, namespace=b.namespace, replica_ttl_s=0.15, sweep_count=1000)
    b.closers.append(ix)
    await asyncio.sleep(1.0)                      # > 6 TTLs of silence for "dead"
    await alive.heartbeat(LOAD)
    await new.heartbeat(LOAD)
    await ix.replicas()
    while sync_redis.get(keys.sweep_cursor) != "0":   # one full SCAN pass
        await ix.replicas()
    assert sync_redis.hgetall(keys.block(CHAIN[4])) == {"b": str(alive.epoch)}
    assert sync_redis.hgetall(keys.block(CHAIN[0])) == {"a": str(new.epoch), "b": str(alive.epoch)}
    assert set(sync_redis.hkeys(keys.registry)) == {"a", "b"}
    assert dead.epoch == 1


async def test_two_routers_same_answer(redis_backend):
    backend = redis_backend
    await backend.start("a", CHAIN[:3])
    await backend.start("b", CHAIN[:6])
    r1, r2 = backend.index(), backend.index()
    assert await r1.match(CHAIN) == await r2.match(CHAIN) == {"a": 3, "b": 6}
    def by_id(rows):
        return sorted(rows, key=lambda row: row[0].replica_id)
    assert by_id(await r1.replicas()) == by_id(await r2.replicas())


async def test_namespace_isolation(redis_server, redis_namespace):
    one = Backend("redis", redis_server.url, redis_namespace + "one:")
    two = Backend("redis", redis_server.url, redis_namespace + "two:")
    await one.start("a", CHAIN)
    await two.start("b", CHAIN[:2])
    assert await one.index().match(CHAIN) == {"a": 8}
    assert await two.index().match(CHAIN) == {"b": 2}
    assert [r.replica_id for r, _ in await two.index().replicas()] == ["b"]
    for c in one.closers + two.closers:
        await c.close()


async def test_redis_killed_then_restarted(caplog):
    server = start_redis()
    port = server.port
    b = Backend("redis", server.url, "kill:")
    try:
        pub = await b.start("a", CHAIN[:4], retry_interval_s=0.0)
        ix = b.index()
        assert await ix.match(CHAIN) == {"a": 4}
        server.stop()
        caplog.set_level(logging.INFO, logger="kvfleet.worker.replica.kv_publisher")
        for call in (lambda: ix.match(CHAIN), ix.replicas):
            t0 = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await call()
            assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        for _ in range(3):                        # the engine never sees the outage
            await pub.publish(CHAIN[4:6], [CHAIN[0]])
            await pub.heartbeat(LOAD)
        assert time.monotonic() - t0 < 3.0 and not pub.connected

        server = start_redis(port=port)           # an empty Redis on the same port
        assert await ix.match(CHAIN) == {}        # the index works again at once
        await pub.heartbeat(LOAD)                 # re-registers and republishes what it holds
        assert pub.connected
        assert await ix.match(CHAIN[1:]) == {"a": 5}
        assert [(r.replica_id, load) for r, load in await ix.replicas()] == [("a", LOAD)]
        messages = [r.getMessage() for r in caplog.records]
        assert sum("unreachable" in m for m in messages) == 1
        assert sum("reachable again" in m for m in messages) == 1
    finally:
        for c in b.closers:
            await c.close()
        server.stop()


async def test_unresponsive_redis_fails_fast_then_recovers():
    server = start_redis()
    b = Backend("redis", server.url, "pause:")
    try:
        pub = await b.start("a", CHAIN[:4], retry_interval_s=0.0)
        ix = b.index()
        assert await ix.match(CHAIN) == {"a": 4}
        server.process.send_signal(signal.SIGSTOP)   # accepts connections, never answers
        try:
            t0 = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await ix.match(CHAIN)
            assert time.monotonic() - t0 < 1.5
            t0 = time.monotonic()
            await pub.heartbeat(LOAD)
            assert time.monotonic() - t0 < 1.5 and not pub.connected
        finally:
            server.process.send_signal(signal.SIGCONT)
        await pub.heartbeat(LOAD)                     # re-registers under a new epoch
        assert pub.connected and pub.epoch == 2
        assert await ix.match(CHAIN) == {"a": 4}
        [(got, load)] = await ix.replicas()
        assert (got.epoch, load) == (2, LOAD)
    finally:
        for c in b.closers:
            await c.close()
        server.stop()


async def test_a_malformed_registry_entry_is_skipped_not_fatal(redis_backend, sync_redis):
    # Issue 24 item 20: one bad entry used to make every read raise, freezing the router's view.
    await redis_backend.start("good", CHAIN[:2])
    await redis_backend.start("bad-json", CHAIN[:1])
    await redis_backend.start("bad-field", CHAIN[:1])
    keys = IndexKeys(redis_backend.namespace)
    sync_redis.hset(keys.registry, "bad-json", "{not json")
    sync_redis.hset(keys.registry, "bad-field", json.dumps({"address": "x:1", "model": "m"}))
    ix = redis_backend.index(ttl_s=10.0)
    assert [i.replica_id for i, _ in await ix.replicas()] == ["good"]


async def test_load_forecast_fields_and_an_older_replicas_record(backend, redis_namespace,
                                                                 request):
    a = await backend.start("a", CHAIN)
    forecast = ReplicaLoad(3, 1, 40, 64, 1.7e9, queue_delay_s=0.75, prefill_token_s=0.0005)
    await a.heartbeat(forecast)
    ix = backend.index()
    assert [load for _, load in await ix.replicas()] == [forecast]
    if backend.kind != "redis":
        return  # only Redis holds records an older replica wrote
    # An older replica writes the five leading fields only (rolling upgrade).
    r = request.getfixturevalue("sync_redis")
    key = IndexKeys(redis_namespace).load("a")
    r.delete(key)
    r.hset(key, mapping=dict(zip(("running", "waiting", "num_free_blocks", "num_total_blocks",
                                  "updated_at"), ("3", "1", "40", "64", "1700000000.0"))))
    r.pexpire(key, 60_000)
    assert [load for _, load in await ix.replicas()] == [LOAD]
