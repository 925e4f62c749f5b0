"""``predicted_ttft`` scoring with synthetic candidates: queue delay and per-token prefill cost
per replica, against the prefix match; its fallback and the bounds it keeps from prefix_aware."""

from __future__ import annotations

import pytest

from kvfleet.index_keys import ReplicaLoad
from kvfleet.router.policy import Candidate, PrefixAware, make_policy
from kvfleet.router.predicted_ttft import MAX_REPORT_AGE_S, PredictedTTFT, report_age, room_order
from tests.unit.router import factories

FAST = 0.001  # seconds per uncached prompt token


def cand(rid: str, matched: int = 0, delay: float | None = 0.0, per_token: float | None = FAST,
         **kw) -> Candidate:
    return factories.cand(rid, matched, delay=delay, per_token=per_token, at=100.0, **kw)


def chain(name: bytes, n: int = 64) -> list[bytes]:
    return factories.chain(name, n)


def test_the_score_is_queue_delay_plus_uncached_tokens_times_cost():
    c = cand("a", matched=60, delay=0.25)
    # 64 blocks + half a block of prompt, 60 cached: 4 × 16 + 8 = 72 uncached tokens.
    assert PredictedTTFT().predicted_ttft_s(c, chain(b"x")) == pytest.approx(0.25 + 72 * FAST)


def test_a_half_speed_replica_loses_at_equal_queues_and_wins_when_the_other_is_backed_up():
    fast, slow = cand("fast", matched=1), cand("slow", matched=1, per_token=2 * FAST)
    assert PredictedTTFT(miss_weight=0).choose([slow, fast], chain(b"x")) is fast
    # The fast one has 2 s of backlog; the slow one's whole prefill (1,032 tokens) is ~2.06 s.
    busy_fast = cand("fast", matched=1, delay=2.5)
    assert PredictedTTFT(miss_weight=0).choose([slow, busy_fast], chain(b"x")) is slow


def test_the_score_ranks_the_deepest_holders_only():
    # One decision's backlog never moves a request to a shallower holder (a burst drains, a
    # copy stays): 3 s of queue on the holder, an idle replica without the prefix.
    backed_up, idle = cand("a", matched=64, delay=3.0), cand("b")
    assert PredictedTTFT(miss_weight=0).choose([idle, backed_up], chain(b"x")) is backed_up
    # Among holders of the deepest match, the soonest first token wins; a shallower holder
    # with an empty queue does not count.
    busy, free, shallow = (cand("a", matched=64, delay=2.0), cand("b", matched=64, delay=0.5),
                           cand("c", matched=60))
    assert PredictedTTFT().choose([busy, shallow, free], chain(b"x")) is free
    with pytest.raises(ValueError, match="miss_weight"):
        PredictedTTFT(miss_weight=-1)


def test_a_new_family_is_placed_by_load_not_speed():
    fast, slow = cand("fast", running=3), cand("slow", per_token=2 * FAST)
    assert PredictedTTFT().choose([fast, slow], chain(b"new")) is slow


def test_drained_time_and_own_unreported_requests_count():
    # A 3 s old report of 3 s backlog: drained since.
    old = cand("a", matched=64, delay=3.0, age=3.0)
    assert PredictedTTFT().choose([cand("b"), old], chain(b"x")) is old
    # Two requests this router sent since the report (in flight, not counted in it) each
    # bring the prefill this policy predicted for its last requests there. (Other prompts
    # each time: one already sent to "a" would count as held there.)
    policy = PredictedTTFT(miss_weight=0)
    for k in range(3):
        got = policy.choose([cand("a", matched=1), cand("b", matched=1, delay=0.01)],
                            chain(b"x%d" % k))
        assert got.info.replica_id == "a"
    unreported = cand("a", matched=1, inflight=2)
    got = policy.choose([unreported, cand("b", matched=1, delay=0.01)], chain(b"y"))
    assert got.info.replica_id == "b"


def test_report_age_is_clamped():
    load = ReplicaLoad(0, 0, 1, 1, 100.0, 0.0, FAST)
    assert report_age(load, 101.5) == pytest.approx(1.5)
    assert report_age(load, 99.0) == 0.0  # a clock offset, not negative work
    assert report_age(load, 1e9) == MAX_REPORT_AGE_S
    assert report_age(None, 5.0) == 0.0


def test_without_the_forecast_fields_it_decides_as_prefix_aware():
    old_a = cand("a", matched=3, delay=None, per_token=None, inflight=5)
    new_b = cand("b", delay=9.0)  # one new replica: seconds and counts do not compare
    pa = PrefixAware().choose([old_a, new_b], chain(b"x", 8))
    assert PredictedTTFT().choose([old_a, new_b], chain(b"x", 8)).info.replica_id == pa.info.replica_id == "b"
    no_report = factories.cand("c", 8, reported=False)
    assert PredictedTTFT().choose([no_report, cand("d", delay=0.0)], chain(b"x", 8)) is no_report
    with pytest.raises(ValueError, match="advertises no queue delay"):
        PredictedTTFT().predicted_ttft_s(old_a, chain(b"x"))


def test_a_hot_prefix_still_gets_more_holders():
    policy = PredictedTTFT(max_imbalance=1.25, popularity_window=64)
    fleet, hot, holders = ["a", "b", "c", "d"], chain(b"hot"), {"a"}
    for _ in range(200):  # the holders' queues stay empty: only the bound adds holders
        cands = [cand(r, matched=64 if r in holders else 0) for r in fleet]
        holders.add(policy.choose(cands, hot).info.replica_id)
    assert holders == set(fleet)


def test_a_saturated_replica_is_skipped_and_options_pass_through():
    full, free = cand("a", matched=64, free=0), cand("b", delay=5.0)
    assert PredictedTTFT().choose([full, free], chain(b"x")) is free
    policy = make_policy("predicted_ttft", max_imbalance=2.0)
    assert isinstance(policy, PredictedTTFT) and policy.max_imbalance == 2.0 and policy.uses_index


def route_many(policy, holder_delay: float, holder_running: int, n: int = 1000) -> set[str]:
    """Replicas that got a request of prefix ``x`` held only by ``a``, over ``n`` decisions in
    which ``a``'s backlog is ``holder_delay`` seconds at ``holder_running`` requests and the
    others are idle (the reports do not change: only the bound can add a holder)."""
    got = set()
    for _ in range(n):
        cands = [cand("a", matched=64, delay=holder_delay, running=holder_running)] + \
            [cand(r) for r in "bcd"]
        got.add(policy.choose(cands, chain(b"x")).info.replica_id)
    return got


def test_the_bound_counts_seconds_not_requests():
    # Six short requests on the holder, 0.3 s of backlog: prefix_aware's count bound copies the
    # prefix; in seconds the holder is far less busy than a copy costs (1,032 tokens, ~1 s,
    # × (1 + miss_weight)), so it keeps the prefix, at any miss weight.
    assert route_many(PrefixAware(popularity_window=10_000), 0.0, 6) != {"a"}
    for weight in (0.0, 3.0):
        stay = PredictedTTFT(miss_weight=weight, popularity_window=10_000)
        assert route_many(stay, 0.3, 6) == {"a"}
    # Kept up (the bound's backlog averages over ~8 decisions here), 3 s of backlog is
    # worth a copy at miss weight 1 (~2 s over the mean), not at 3 (~4 s) ...
    assert route_many(PredictedTTFT(miss_weight=1, popularity_window=10_000), 3.0, 0) != {"a"}
    assert route_many(PredictedTTFT(miss_weight=3, popularity_window=10_000), 3.0, 0) == {"a"}
    # ... and 8 s is at 3, though the holder's request count matches the others' (a slow
    # replica: few requests, many seconds).
    assert route_many(PredictedTTFT(miss_weight=3, popularity_window=10_000), 8.0, 0) != {"a"}


def test_the_bound_in_seconds_fires_within_a_few_decisions_without_a_warm_up():
    # A holder 8 s behind (a slow replica's cold start): the copy comes on the first decisions,
    # not after prefix_aware's warm-up (16 decisions per replica) and a 64-per-replica average.
    policy = PredictedTTFT(miss_weight=3, popularity_window=10_000)
    got = [next(iter(route_many(policy, 8.0, 0, n=1))) for _ in range(32)]
    # ~12 decisions: the average passes the mean + 4 × a copy's ~1 s (64 was the warm-up).
    assert 8 <= got.index(next(r for r in got if r != "a")) < 16
    # A backlog that lasted one decision is forgotten in a few: the average is short.
    policy = PredictedTTFT(miss_weight=3, popularity_window=10_000)
    route_many(policy, 20.0, 0, n=1)
    assert route_many(policy, 0.0, 0, n=20) == {"a"}
    assert policy.avg_backlog_s["a"] < 0.5


def test_without_the_forecast_the_bound_counts_requests():
    # Older replicas report no forecast: the bound is prefix_aware's, in requests.
    got = set()
    policy = PredictedTTFT(popularity_window=10_000)
    for _ in range(200):
        cands = [cand("a", matched=64, delay=None, per_token=None, running=6)] + \
            [cand(r, delay=None, per_token=None) for r in "bcd"]
        got.add(policy.choose(cands, chain(b"x")).info.replica_id)
    assert got != {"a"}


def test_a_prefix_sent_but_not_yet_indexed_counts_as_held_by_its_replica():
    # The index shows nothing of family "n" yet (its first prefill is still queued on "a"):
    # its next request follows it instead of being placed as new on the idler "b".
    policy = PredictedTTFT()
    first = policy.choose([cand("a"), cand("b", running=1)], chain(b"n") + [b"q1"])
    assert first.info.replica_id == "a"
    second = policy.choose([cand("a", inflight=1, delay=0.7), cand("b")], chain(b"n") + [b"q2"])
    assert second.info.replica_id == "a" and second.matched_blocks == 0  # the router's candidate
    # Past the horizon (32 decisions of other prompts) the memory no longer vouches for it.
    for k in range(40):
        policy.choose([cand("a"), cand("b")], chain(b"other%d" % k))
    third = policy.choose([cand("a", delay=2.0), cand("b")], chain(b"n") + [b"q3"])
    assert third.info.replica_id == "b"


def test_a_new_prefix_goes_where_the_working_set_has_room_unless_backlogged():
    policy = PredictedTTFT()
    for k in range(3):  # three families to "a", one to "b": "a"'s working set is larger
        policy.sent.record(chain(b"fa%d" % k), "a", k + 1)
    policy.sent.record(chain(b"fb"), "b", 4)
    # "b" has more room, though it is busier by count.
    assert policy.choose([cand("a"), cand("b", running=4)], chain(b"new1")).info.replica_id == "b"
    # A backlog longer than the prompt's full prefill (1,032 tokens × 1 ms ≈ 1 s) rules "b" out.
    got = policy.choose([cand("a"), cand("b", delay=2.0)], chain(b"new2"))
    assert got.info.replica_id == "a"
    # Every replica backlogged: room decides again ("b" got new1, "a" new2: equal, then load).
    got = policy.choose([cand("a", delay=2.0, running=2), cand("b", delay=2.0)], chain(b"new3"))
    assert got.info.replica_id == "b"
    # Without the forecast (a rolling upgrade, a replica not yet reported) room still places
    # it, unguarded: "b" holds 3 families' blocks now, "a" 5.
    old = [cand(r, delay=None, per_token=None, running=3 if r == "b" else 0) for r in "ab"]
    policy.sent.record(chain(b"fa3"), "a", 8)
    assert policy.choose(old, chain(b"new4")).info.replica_id == "b"


def test_room_is_the_working_set_as_a_share_of_the_replicas_kv():
    assert room_order(5, cand("a", free=10)) == pytest.approx(0.5)  # 10 blocks in all
    no_report = factories.cand("c", reported=False)
    assert room_order(5, no_report) == 5.0
