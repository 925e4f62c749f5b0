"""The peer hint (issue 26 §2): a request routed away from a longer match names the holder;
and (§3) a node tier holding more of the chain than any replica — a drained replica's blocks —
is named as the source instead."""

import asyncio
from dataclasses import replace

import numpy as np

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad, tier_id
from kvfleet.router.peer_hint import PeerSource, best_holder, pick_source, set_hint
from kvfleet.router.prefix_index import InMemoryPrefixIndex
from kvfleet.v1 import worker_pb2
from kvfleet.worker.kv_tier.peer_pull import PeerHint
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.router.test_policy import cand


def test_a_request_routed_away_from_the_longest_match_names_its_holder():
    holder, chosen, short = cand("a", matched=6), cand("b", matched=1), cand("c", matched=3)
    assert best_holder([chosen, short, holder], chosen) is holder
    source = pick_source([chosen, short, holder], chosen, {})
    assert source == PeerSource(6, "a", holder.info.address)
    req = worker_pb2.WorkerGenerateRequest()
    set_hint(req, source, chosen)
    assert (req.peer.replica_id, req.peer.address, req.peer.tier_id) == ("a", holder.info.address, "")
    assert (req.peer.num_blocks, req.peer.first_block) == (6, 1)
    assert PeerHint.from_proto(req.peer) == PeerHint("a", holder.info.address, 6, 1)


def test_no_hint_when_the_chosen_replica_holds_as_much_or_is_alone():
    chosen = cand("a", matched=4)
    assert best_holder([chosen, cand("b", matched=4)], chosen) is None
    assert best_holder([chosen], chosen) is None
    assert best_holder([cand("b", matched=5)], chosen, min_blocks=2) is None
    assert best_holder([cand("a", matched=9), chosen], chosen) is None  # itself, not a peer


def test_no_hint_when_the_chosen_replicas_own_node_tier_covers_the_gap():
    holder = cand("a", matched=6)
    covered = replace(cand("b", matched=1), host_blocks=5)
    assert best_holder([holder, covered], covered) is None
    partly = replace(cand("b", matched=1), host_blocks=3)
    assert best_holder([holder, partly], partly) is holder


def on_node(c, node: str):
    return replace(c, info=replace(c.info, kv_tier=tier_id(node)))


def test_a_node_tier_holding_more_than_any_replica_is_the_source():
    chosen = on_node(cand("b", matched=1), "n1")
    holder = cand("a", matched=4)
    runs = {tier_id("n2"): 6, tier_id("n3"): 2}
    source = pick_source([chosen, holder], chosen, runs)
    assert source == PeerSource(6, tier_id=tier_id("n2"))
    req = worker_pb2.WorkerGenerateRequest()
    set_hint(req, source, chosen)
    assert PeerHint.from_proto(req.peer) == PeerHint("", "", 6, 1, tier_id("n2"))
    # A tie with a live holder: the tier (no other engine's step to wait for).
    assert pick_source([chosen, cand("a", matched=6)], chosen, runs).tier_id == tier_id("n2")
    # A replica holding more still wins.
    assert pick_source([chosen, cand("a", matched=7)], chosen, runs).replica_id == "a"


def test_no_tier_source_for_the_chosen_replicas_own_tier_or_what_it_reaches():
    chosen = on_node(replace(cand("b", matched=1), host_blocks=4), "n1")
    assert pick_source([chosen], chosen, {tier_id("n1"): 9}) is None  # restored at admission
    assert pick_source([chosen], chosen, {tier_id("n2"): 5}) is None  # reaches 5 already
    assert pick_source([chosen], chosen, {tier_id("n2"): 6}) == PeerSource(6, tier_id=tier_id("n2"))
    assert pick_source([chosen], chosen, {tier_id("n2"): 6}, min_blocks=2) is None


def test_a_hint_naming_a_tier_is_checked():
    import pytest

    from kvfleet.errors import InvalidArgument

    for peer in (worker_pb2.PeerHint(tier_id="n2", num_blocks=3),  # not a tier id
                 worker_pb2.PeerHint(tier_id=tier_id("n2"), address="h:1", num_blocks=3)):
        with pytest.raises(InvalidArgument) as err:
            PeerHint.from_proto(peer)
        assert err.value.field == "peer.tier_id"


def test_the_router_names_a_drained_replicas_tier_on_another_node():
    """The survivor is on node n1; the drained replica's blocks sit in node n2's tier, which
    no live replica names: the route's tier runs find them and the hint names that tier."""
    from tests.unit.router.test_tier_credit import route_with_tiers

    async def scenario():
        index = InMemoryPrefixIndex()
        pub = index.publisher(ReplicaInfo("survivor", "127.0.0.1:1", "m", 0, 16,
                                          kv_tier=tier_id("n1")))
        await pub.register()
        await pub.heartbeat(ReplicaLoad(0, 0, 64, 64, 1.7e9))
        drained = HostTierStore(1 << 20, listener=index.tier_publisher(tier_id("n2")).record)
        chain = [bytes([7]) * 8 + i.to_bytes(8, "big") for i in range(6)]
        drained.put(0, chain[:5], np.zeros((5, 8), dtype=np.uint8))
        (decision,) = await route_with_tiers(index, "prefix_aware", [chain], decisions=True)
        assert decision.tier_runs == {tier_id("n2"): 5}
        source = pick_source(decision.candidates, decision.candidate, decision.tier_runs)
        assert source == PeerSource(5, tier_id=tier_id("n2"))
    asyncio.run(scenario())
