"""Routing policies decide from (matched blocks, load, prefix popularity); no Redis or Ray needed."""

import pytest

from kvfleet.router.policy import (
    Candidate,
    LeastLoaded,
    PrefixAware,
    PrefixPopularity,
    RoundRobin,
    make_policy,
    rendezvous_score,
)
from tests.unit.router import factories


def cand(rid: str, matched: int = 0, **kw) -> Candidate:
    return factories.cand(rid, matched, **kw)


def chain(name: bytes, n: int = 8) -> list[bytes]:
    return factories.chain(name, n)


def test_prefix_aware_prefers_the_longest_holder_over_the_first_block_owner():
    first = b"first-block"
    owner = max(["a", "b"], key=lambda r: rendezvous_score(first, r))
    other = "b" if owner == "a" else "a"
    holder, rdv_pick = cand(other, matched=6), cand(owner, matched=1)
    # Rendezvous on the first block alone would pick `owner`; the longest holder wins anyway.
    blocks = [first] + chain(b"rest", 7)
    assert PrefixAware().choose([rdv_pick, holder], blocks).info.replica_id == other
    assert PrefixAware().choose([holder, rdv_pick], blocks).info.replica_id == other


def test_prefix_aware_spreads_when_the_holder_is_much_busier():
    holder, idle = cand("a", matched=3, inflight=5), cand("b")
    assert PrefixAware(load_penalty_blocks=1.0).choose([holder, idle], chain(b"x")) is idle
    busy_but_worth_it = cand("a", matched=8, inflight=2)
    assert PrefixAware(load_penalty_blocks=1.0).choose([busy_but_worth_it, idle], chain(b"x")) is busy_but_worth_it


def test_new_families_go_least_loaded_then_rendezvous_consistently():
    a, b = cand("a", running=1), cand("b")
    assert PrefixAware().choose([a, b], [b"k"]) is b
    owner = max(["r1", "r2"], key=lambda r: rendezvous_score(b"k", r))
    # Same choice whatever the candidate order, from any router (two routers, same state).
    for order in ([cand("r1"), cand("r2")], [cand("r2"), cand("r1")]):
        assert PrefixAware().choose(order, [b"k"]).info.replica_id == owner


@pytest.mark.parametrize("name", ["prefix_aware", "predicted_ttft", "least_loaded"])
def test_equal_candidates_with_no_block_to_hash_take_turns(name):
    # A prompt shorter than a block (or a router routing blind): no family to keep together, so
    # an idle fleet's requests alternate instead of all going to one replica.
    policy = make_policy(name)
    picks = [policy.choose([cand("b"), cand("a"), cand("c")], []).info.replica_id
             for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    busy = [cand("a", inflight=1), cand("b"), cand("c")]
    assert {policy.choose(busy, []).info.replica_id for _ in range(4)} == {"b", "c"}


def test_equal_holders_split_by_load():
    a, b = cand("a", matched=8, inflight=2), cand("b", matched=8, inflight=1)
    assert PrefixAware().choose([a, b, cand("c")], chain(b"x")) is b


def test_a_hot_prefix_gets_more_holders_a_cold_one_never_does():
    policy = PrefixAware(max_imbalance=1.25, popularity_window=64)
    fleet = ["a", "b", "c", "d"]
    hot = chain(b"hot")
    holders = {"a"}
    for i in range(200):  # every request is the hot family: it needs every replica
        cands = [cand(r, matched=8 if r in holders else 0, inflight=i % 2) for r in fleet]
        holders.add(policy.choose(cands, hot).info.replica_id)
    assert holders == set(fleet)

    policy, holders = PrefixAware(max_imbalance=1.25, popularity_window=64), {}
    families = [chain(b"f%d" % f) for f in range(8)]
    for i in range(400):  # eight equally popular families on four replicas: one holder each
        fam = i % 8
        cands = [cand(r, matched=8 if holders.get(fam) == r else 0) for r in fleet]
        got = policy.choose(cands, families[fam]).info.replica_id
        assert holders.setdefault(fam, got) == got


def test_a_prefix_on_a_persistently_overloaded_holder_gets_a_copy_after_warm_up():
    # A rare prefix (popularity stays tiny) on a holder that stays busier than the bound.
    policy = PrefixAware(max_imbalance=1.25, load_window=4, popularity_window=10**6)
    cold = chain(b"cold")
    picks = [policy.choose([cand("a", matched=8, inflight=3), cand("b"), cand("c", running=1)],
                           cold).info.replica_id for _ in range(48)]
    assert picks[:47] == ["a"] * 47   # smoothed loads warming up (16 samples × 3 replicas)
    assert picks[47] == "b"            # then a copy on the least-loaded replica
    # Within the bound nothing moves, however long it runs.
    policy = PrefixAware(max_imbalance=1.25, load_window=4, popularity_window=10**6)
    for _ in range(50):
        got = policy.choose([cand("a", matched=8, inflight=1), cand("b", inflight=1),
                             cand("c", running=1)], cold)
        assert got.info.replica_id == "a"


def test_an_idle_fleet_keeps_a_prefix_on_its_holder():
    # A load report is up to one heartbeat old: on an idle fleet the replica that served the
    # last request still shows it running. 1 request against 0 is a large ratio but no load;
    # copying the prefix would cost a full prefill for nothing (the bound needs an absolute floor).
    policy = PrefixAware(max_imbalance=1.25, load_window=4, popularity_window=10**6)
    conv = chain(b"chat")
    for _ in range(200):
        got = policy.choose([cand("a", matched=8, running=1), cand("b"), cand("c"), cand("d")],
                            conv)
        assert got.info.replica_id == "a"
    # The same holder two requests over the mean is overloaded: it gets a copy after warm-up.
    policy = PrefixAware(max_imbalance=1.25, load_window=4, popularity_window=10**6)
    picks = [policy.choose([cand("a", matched=8, running=3), cand("b"), cand("c"), cand("d")],
                           conv).info.replica_id for _ in range(200)]
    assert set(picks) > {"a"}
    with pytest.raises(ValueError, match="min_excess_load"):
        PrefixAware(min_excess_load=-1)


def test_a_copy_in_flight_counts_as_a_holder():
    policy = PrefixAware(max_imbalance=1.0, popularity_window=8)
    hot = chain(b"hot")
    for _ in range(3):  # warm the popularity: one holder is not enough for this share
        policy.choose([cand("a", matched=8), cand("b"), cand("c")], hot)
    # The index does not show the copies yet: the policy must not start one per request.
    picks = [policy.choose([cand("a", matched=8), cand("b"), cand("c")], hot).info.replica_id
             for _ in range(6)]
    assert picks.count("b") <= 1 and picks.count("c") <= 1


def test_kv_saturated_replicas_are_skipped_while_another_can_admit():
    full, free = cand("a", matched=8, free=0), cand("b")
    assert PrefixAware().choose([full, free], chain(b"x")) is free
    assert PrefixAware().choose([full], chain(b"x")) is full


def test_popularity_share_converges_to_the_frequency():
    pop = PrefixPopularity(window=50)
    for i in range(2000):
        share = pop.observe(b"a") if i % 4 == 0 else pop.observe(b"b%d" % (i % 3))
    assert pop.observe(b"a") == pytest.approx(0.25, abs=0.08)


def test_load_uses_the_larger_of_report_and_own_inflight():
    assert cand("a", inflight=3, running=1).load == 3
    assert cand("a", inflight=0, running=2, waiting=2).load == 4
    # The report counts 2 of this router's requests that have finished since: 4 - 2.
    assert cand("a", inflight=1, running=2, waiting=2, settled=2).load == 2
    assert cand("a", inflight=1, running=1, settled=1).load == 1
    assert cand("a", running=1, settled=3).load == 0  # never negative


def test_a_finished_request_in_a_stale_report_does_not_push_a_chat_off_its_holder():
    # Turn 1 of a chat ran on "a"; a heartbeat taken while it ran still says running=1, and
    # one more request of this router that finished since (running=2 in the report). Turn 2
    # matches 2 blocks on "a" and 1 (the chat template) on "b": scored on the stale report,
    # "b" wins (2 - 2 < 1 - 0) though it holds nothing useful.
    stale = cand("a", matched=2, running=2)
    assert PrefixAware().choose([stale, cand("b", matched=1)], chain(b"c")).info.replica_id == "b"
    # The router knows that request finished after the report: "a" keeps the conversation.
    known = cand("a", matched=2, running=2, settled=2)
    assert PrefixAware().choose([known, cand("b", matched=1)], chain(b"c")) is known


def test_equal_scores_go_to_the_deeper_match():
    # Turn 1 went through another router: this one cannot know it finished (settled=0). The
    # score ties (2 - 1 = 1 - 0) and the deeper match keeps the conversation on its holder.
    stale = cand("a", matched=2, running=1)
    assert PrefixAware().choose([stale, cand("b", matched=1)], chain(b"c")) is stale
    assert PrefixAware().choose([cand("b", matched=1), stale], chain(b"c")) is stale
    # A higher score still wins over depth: one request busier is worth only one block.
    busier = cand("a", matched=2, running=2)
    assert PrefixAware().choose([busier, cand("b", matched=1)], chain(b"c")).info.replica_id == "b"
    assert cand("a", free=5).kv_usage == pytest.approx(0.5)


def test_baselines_and_factory():
    cs = [cand("a", running=2), cand("b"), cand("c", running=1)]
    assert LeastLoaded().choose(cs, []).info.replica_id == "b"
    rr = RoundRobin()
    assert [rr.choose(cs, []).info.replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert make_policy("prefix_aware", max_imbalance=2.0).max_imbalance == 2.0
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")
