"""Routing policies decide from (matched blocks, load); no Redis or Ray needed."""

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import Candidate, LeastLoaded, PrefixAware, RoundRobin, rendezvous_score


def cand(rid: str, matched: int = 0, inflight: int = 0, running: int = 0, waiting: int = 0):
    load = ReplicaLoad(running, waiting, 10, 10, 0.0)
    return Candidate(ReplicaInfo(rid, f"127.0.0.1:{len(rid)}", "m", 1, 16), load, matched, inflight)


def test_prefix_aware_prefers_the_longest_holder_over_the_first_block_owner():
    a, b = cand("a", matched=1), cand("b", matched=6)
    first = b"first-block"
    # Rendezvous alone would pick one of them on the first block; the holder must win anyway.
    assert PrefixAware().choose([a, b], first) is b
    assert PrefixAware().choose([b, a], first) is b


def test_prefix_aware_spreads_when_the_holder_is_much_busier():
    holder, idle = cand("a", matched=3, inflight=5), cand("b")
    assert PrefixAware(load_penalty_blocks=1.0).choose([holder, idle], b"x") is idle
    busy_but_worth_it = cand("a", matched=8, inflight=2)
    assert PrefixAware(load_penalty_blocks=1.0).choose([busy_but_worth_it, idle], b"x") is busy_but_worth_it


def test_ties_go_to_least_loaded_then_rendezvous_consistently():
    a, b = cand("a", running=1), cand("b")
    assert PrefixAware().choose([a, b], b"k") is b
    c1, c2 = cand("r1"), cand("r2")
    owner = max(["r1", "r2"], key=lambda r: rendezvous_score(b"k", r))
    # Same choice whatever the candidate order (two routers, same state → same replica).
    assert PrefixAware().choose([c1, c2], b"k").info.replica_id == owner
    assert PrefixAware().choose([c2, c1], b"k").info.replica_id == owner


def test_load_uses_the_larger_of_report_and_own_inflight():
    assert cand("a", inflight=3, running=1).load == 3
    assert cand("a", inflight=0, running=2, waiting=2).load == 4


def test_baselines():
    cs = [cand("a", running=2), cand("b"), cand("c", running=1)]
    assert LeastLoaded().choose(cs, b"").info.replica_id == "b"
    rr = RoundRobin()
    assert [rr.choose(cs, b"").info.replica_id for _ in range(4)] == ["a", "b", "c", "a"]
