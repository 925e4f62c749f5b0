"""Issue 26 §1: host-tier residency in the in-memory index, and the router's credit for it —
the weight from the step-cost model, ``prefix_aware``'s score, ``predicted_ttft``'s prefill
seconds, and a route through the router's core preferring the replica whose node tier holds
the prefix over a cold one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad, tier_id
from kvfleet.router.auth import Authenticator
from kvfleet.router.core import RouterCore
from kvfleet.router.policy import Candidate, PrefixAware, make_policy
from kvfleet.router.predicted_ttft import PredictedTTFT
from kvfleet.router.prefix_index import IndexUnavailable, InMemoryPrefixIndex
from kvfleet.router.replica_set import ReplicaSet
from kvfleet.router.tier_credit import (
    DEFAULT_HOST_HIT_WEIGHT,
    MEASURED_BLOCK_SIZE,
    RESTORE_BLOCK_S,
    host_hit_weight,
)
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.step_cost.model import MEASURED
from tests.unit.router import factories

BLOCK = np.zeros((1, 8), dtype=np.uint8)  # one 8-byte block
PER_TOKEN = 0.001


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


CHAIN = [h(i) for i in range(8)]


def cand(rid: str, matched: int = 0, host: int = 0, load: int = 0,
         per_token: float | None = PER_TOKEN) -> Candidate:
    return factories.cand(rid, matched, host=host, running=load, at=100.0, kv_tier=f"tier:{rid}",
                          delay=0.0 if per_token else None, per_token=per_token)


def test_the_weight_comes_from_restore_and_prefill_seconds_per_block():
    expected = 1 - RESTORE_BLOCK_S / (MEASURED.prefill_token_s * MEASURED_BLOCK_SIZE)
    assert DEFAULT_HOST_HIT_WEIGHT == round(expected, 2) == 0.95
    assert host_hit_weight(1.0, 0.01, 16) == 0.0  # restore dearer than prefill: worth nothing
    with pytest.raises(ValueError, match="prefill_token_s > 0"):
        host_hit_weight(0.01, 0.0, 16)
    with pytest.raises(ValueError, match="host_hit_weight"):
        PrefixAware(host_hit_weight=1.5)


def test_prefix_aware_counts_host_hits_at_their_weight():
    policy = PrefixAware()
    # 6 host blocks (5.7 at 0.95) beat 5 device blocks, lose to 6 device blocks.
    assert policy.choose([cand("dev", matched=5), cand("host", host=6)], CHAIN).info.replica_id == "host"
    assert policy.choose([cand("dev", matched=6), cand("host", host=6)], CHAIN).info.replica_id == "dev"
    # device + host on one replica add up
    pick = PrefixAware().choose([cand("dev", matched=4), cand("both", matched=2, host=3)], CHAIN)
    assert pick.info.replica_id == "both"
    # weight 0: host hits are ignored, the device holder wins
    none = PrefixAware(host_hit_weight=0.0)
    assert none.choose([cand("dev", matched=1), cand("host", host=6)], CHAIN).info.replica_id == "dev"


def test_predicted_ttft_prices_host_blocks_at_their_restore_not_their_prefill():
    policy = PredictedTTFT()
    cold, warm = cand("cold"), cand("warm", host=6)
    saved = policy.own_prefill_s(cold, CHAIN) - policy.own_prefill_s(warm, CHAIN)
    assert saved == pytest.approx(DEFAULT_HOST_HIT_WEIGHT * 6 * 16 * PER_TOKEN)
    assert policy.choose([cold, warm], CHAIN) is warm  # a host hit alone is not a "new family"


def _store_with_index(index: InMemoryPrefixIndex, node: str, capacity_blocks: int) -> HostTierStore:
    return HostTierStore(capacity_blocks * BLOCK.nbytes,
                         listener=index.tier_publisher(tier_id(node)).record)


def test_the_in_memory_index_follows_the_tier_store_puts_and_evictions():
    async def scenario():
        index = InMemoryPrefixIndex()
        store = _store_with_index(index, "n1", capacity_blocks=5)
        store.put(0, CHAIN[:3], np.repeat(BLOCK, 3, axis=0))
        store.put(1, CHAIN[3:5], np.repeat(BLOCK, 2, axis=0))  # rank 1's shards: not shown
        starts = {"a": (tier_id("n1"), 0), "b": (tier_id("n1"), 1), "c": (tier_id("n2"), 0)}
        assert await index.host_match(CHAIN, starts) == {"a": 3, "b": 2}
        store.put(0, CHAIN[3:4], BLOCK)  # evicts the oldest: the chain's first block
        assert index.tiers[tier_id("n1")][1] == {h(1), h(2), h(3)}
        assert await index.host_match(CHAIN, starts) == {"b": 3}
        store.clear()
        assert await index.host_match(CHAIN, starts) == {}
        index.available = False
        with pytest.raises(IndexUnavailable):
            await index.host_match(CHAIN, starts)
    asyncio.run(scenario())


def test_a_registry_entry_names_its_tier_and_older_entries_still_parse():
    info = ReplicaInfo("r", "127.0.0.1:1", "m", 1, 16, kv_tier="tier:abc")
    assert ReplicaInfo.from_json("r", info.to_json(0.0)).kv_tier == "tier:abc"
    old = '{"address": "127.0.0.1:1", "model": "m", "epoch": 1, "block_size": 16}'
    assert ReplicaInfo.from_json("r", old).kv_tier == ""


async def route_with_tiers(index: InMemoryPrefixIndex | object, policy: str, chains,
                           decisions: bool = False) -> list:
    """The replica the router's core picks for each chain (``index``: its prefix index), or
    the whole decisions."""
    replicas = ReplicaSet(index)  # type: ignore[arg-type]
    await replicas.refresh()
    core = RouterCore({}, "", replicas=replicas, policy=make_policy(policy),
                      auth=Authenticator({}))

    class Model:
        name = "m"
    try:
        out = [await core.route(Model(), c) for c in chains]  # type: ignore[arg-type]
        return out if decisions else [d.candidate.info.replica_id for d in out]
    finally:
        core.close()


@pytest.mark.parametrize("policy", ["prefix_aware", "predicted_ttft"])
def test_the_router_prefers_the_replica_whose_node_tier_holds_the_prefix(policy):
    async def scenario():
        index = InMemoryPrefixIndex()
        load = ReplicaLoad(0, 0, 64, 64, 1.7e9, 0.0, PER_TOKEN)
        for rid, node in (("cold", "n1"), ("warm", "n2")):
            pub = index.publisher(ReplicaInfo(rid, f"127.0.0.1:{len(rid)}", "m", 0, 16,
                                              kv_tier=tier_id(node)))
            await pub.register()
            await pub.heartbeat(load)
        store = _store_with_index(index, "n2", capacity_blocks=64)
        families = [[bytes([f]) * 8 + h(i)[8:] for i in range(6)] for f in range(8)]
        for chain in families:
            store.put(0, chain, np.repeat(BLOCK, len(chain), axis=0))
        assert await route_with_tiers(index, policy, families) == ["warm"] * len(families)
        store.clear()  # evicted from the tier: no credit, families split by rendezvous
        assert set(await route_with_tiers(index, policy, families)) == {"cold", "warm"}
    asyncio.run(scenario())
