"""InMemoryPrefixIndex: the semantics the Redis index has, checked without Redis.

The same scenarios run against real Redis and this class in tests/integration/test_index_redis.py.
"""

from __future__ import annotations

import pytest

from kvfleet.index_keys import IndexKeys, ReplicaInfo, ReplicaLoad, pack_chain
from kvfleet.router.prefix_index import IndexUnavailable, InMemoryPrefixIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


CHAIN = [h(i) for i in range(8)]
LOAD = ReplicaLoad(running=2, waiting=1, num_free_blocks=90, num_total_blocks=100, updated_at=5.0)


def info(rid: str) -> ReplicaInfo:
    return ReplicaInfo(rid, f"127.0.0.1:{5000 + len(rid)}", "tiny", 0, 16)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def index(clock: FakeClock) -> InMemoryPrefixIndex:
    return InMemoryPrefixIndex(replica_ttl_s=10.0, clock=clock)


async def start(index: InMemoryPrefixIndex, rid: str, blocks: list[bytes]):
    pub = index.publisher(info(rid), replica_ttl_s=10.0)
    await pub.register()
    await pub.publish(blocks, [])
    return pub


async def test_leading_match_stops_at_first_miss(index):
    await start(index, "a", CHAIN[:5])
    await start(index, "b", [CHAIN[0], CHAIN[1], CHAIN[3]])
    await start(index, "c", CHAIN[1:])          # lacks block 0
    await start(index, "d", CHAIN)
    assert await index.match(CHAIN) == {"a": 5, "b": 2, "d": 8}
    assert await index.match(CHAIN[:1]) == {"a": 1, "b": 1, "d": 1}
    assert await index.match([]) == {}
    assert await index.match([h(99)]) == {}


async def test_epoch_increases_and_restart_hides_old_entries(index):
    old = await start(index, "a", CHAIN)
    new = index.publisher(info("a"))
    await new.register()
    assert (old.epoch, new.epoch, new.replica.epoch) == (1, 2, 2)
    assert await index.match(CHAIN) == {}
    await old.publish(CHAIN, [])                 # a lingering old process writes nothing
    await old.heartbeat(LOAD)
    assert await index.match(CHAIN) == {}
    await new.publish(CHAIN[:3], [])
    assert await index.match(CHAIN) == {"a": 3}
    assert all(index.blocks[x] == {"a": 2} for x in CHAIN[:3])
    assert index.blocks[CHAIN[3]] == {}          # the old epoch's member was cleaned by match


async def test_expired_heartbeat_stops_counting_until_next_beat(index, clock):
    pub = await start(index, "a", CHAIN)
    clock.now += 10.5
    assert await index.match(CHAIN) == {}
    assert await index.replicas() == []
    await pub.heartbeat(LOAD)
    assert [r.replica_id for r, _ in await index.replicas()] == ["a"]


async def test_removed_hashes_and_a_hash_in_both_lists(index):
    pub = await start(index, "a", CHAIN)
    await pub.publish([], [CHAIN[2]])
    assert await index.match(CHAIN) == {"a": 2}
    await pub.publish([CHAIN[2]], [CHAIN[2]])     # removed applies first: it ends stored
    assert await index.match(CHAIN) == {"a": 8}


async def test_replicas_and_load_ttl(index, clock):
    pub = await start(index, "a", [])
    [(got, load)] = await index.replicas()
    assert got == ReplicaInfo("a", info("a").address, "tiny", 1, 16) and load is None
    await pub.heartbeat(LOAD)
    assert await index.replicas() == [(got, LOAD)]
    clock.now += 9.0
    assert await index.replicas() == [(got, LOAD)]


async def test_deregister_is_immediate(index):
    pub = await start(index, "a", CHAIN)
    await start(index, "b", CHAIN[:2])
    await pub.deregister()
    assert await index.match(CHAIN) == {"b": 2}
    assert [r.replica_id for r, _ in await index.replicas()] == ["b"]


async def test_blocks_published_before_register_are_republished(index):
    pub = index.publisher(info("a"))
    await pub.publish(CHAIN[:4], [])
    assert await index.match(CHAIN) == {}
    await pub.register()
    assert await index.match(CHAIN) == {"a": 4}


async def test_sweep_drops_members_of_long_silent_replicas(index, clock):
    await start(index, "a", CHAIN)
    b = await start(index, "b", CHAIN)
    clock.now += 59.0                             # 5.9 TTLs: silent, not yet garbage
    await b.heartbeat(LOAD)
    await index.replicas()
    assert index.blocks[CHAIN[0]] == {"a": 1, "b": 1}
    clock.now += 2.0
    await index.replicas()
    assert index.blocks[CHAIN[0]] == {"b": 1} and "a" not in index.registry


async def test_unavailable_raises_the_typed_error_then_recovers(index):
    await start(index, "a", CHAIN)
    index.available = False
    with pytest.raises(IndexUnavailable):
        await index.match(CHAIN)
    with pytest.raises(IndexUnavailable):
        await index.replicas()
    index.available = True
    assert await index.match(CHAIN) == {"a": 8}


def test_key_layout_is_namespaced():
    k = IndexKeys("ns:")
    assert k.block(bytes(range(16))) == b"ns:block:" + bytes(range(16))
    assert (k.epochs, k.registry, k.heartbeats, k.load("r1"), k.sweep_cursor) == (
        "ns:epochs", "ns:registry", "ns:heartbeats", "ns:load:r1", "ns:sweep_cursor")
    assert IndexKeys().block(b"\x00" * 16).startswith(b"kvfleet:block:")
    assert pack_chain([h(1), h(2)]) == h(1) + h(2)


def test_records_round_trip():
    r = ReplicaInfo("a", "h:1", "m", 7, 16)
    assert ReplicaInfo.from_json("a", r.to_json(started_at=12.5)) == r
    assert ReplicaLoad.from_fields(LOAD.to_fields()) == LOAD
    assert ReplicaLoad.from_fields([None] * 5) is None
