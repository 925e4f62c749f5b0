"""The peer hint (issue 26 §2): a request routed away from a longer match names the holder."""

from dataclasses import replace

from kvfleet.router.peer_hint import best_holder, set_hint
from kvfleet.v1 import worker_pb2
from tests.unit.router.test_policy import cand


def test_a_request_routed_away_from_the_longest_match_names_its_holder():
    holder, chosen, short = cand("a", matched=6), cand("b", matched=1), cand("c", matched=3)
    assert best_holder([chosen, short, holder], chosen) is holder
    req = worker_pb2.WorkerGenerateRequest()
    set_hint(req, holder, chosen)
    assert (req.peer.replica_id, req.peer.address) == ("a", holder.info.address)
    assert (req.peer.num_blocks, req.peer.first_block) == (6, 1)


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
