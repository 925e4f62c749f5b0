"""The tenant-aware spread: a light tenant's burst is split across replicas beside a flood,
a prefix hit still goes to its holder, other tenants' placement is untouched, ties are fixed."""

from __future__ import annotations

from dataclasses import replace

from kvfleet.router.inflight import InflightLedger
from kvfleet.router.policy import Candidate, PrefixAware
from kvfleet.router.predicted_ttft import PredictedTTFT
from kvfleet.router.tenant_spread import light_counts, tenant_excess
from tests.unit.router import factories

FAST = 0.001  # seconds per uncached prompt token


def cand(rid: str, matched: int = 0, **kw) -> Candidate:
    """Both replicas alike: the flood's backlog on each, longer than any prompt's prefill."""
    kw.setdefault("delay", 5.0)
    return factories.cand(rid, matched, per_token=FAST, at=100.0, running=8, waiting=60, **kw)


def flooded_ledger(flood_per_replica: int = 40) -> InflightLedger:
    """This router's open requests: tenant ``flood``'s on each of ``a`` and ``b``."""
    ledger = InflightLedger(lambda: 100.0)
    for rid in "ab":
        for _ in range(flood_per_replica):
            ledger.dispatched(rid, "flood")
    return ledger


def decide(policy, ledger: InflightLedger, tenant: str, chain: list[bytes],
           matched: dict[str, int] | None = None) -> str:
    """One decision as the router builds it (``RouterCore._candidates``); the chosen replica
    is then dispatched to, as the router would."""
    spread = ledger.tenant_spread(tenant)
    cands = [cand(rid, (matched or {}).get(rid, 0), inflight=ledger.inflight[rid],
                  tenant_inflight=spread.get(rid, 0)) for rid in "ab"]
    rid = policy.choose(cands, chain).info.replica_id
    ledger.dispatched(rid, tenant)
    return rid


def test_only_a_light_tenant_beside_others_carries_counts():
    assert light_counts({"a": 3}, others=0, total=3) == {}  # alone: room and load place it
    assert light_counts({"a": 3, "b": 1}, others=1, total=80) == {"a": 3, "b": 1}
    assert light_counts({"a": 40, "b": 40}, others=1, total=84) == {}  # the flood itself
    ledger = flooded_ledger()
    assert ledger.tenant_spread("flood") == {} and ledger.tenant_spread("steady") == {}
    at = ledger.dispatched("a", "steady")
    assert ledger.tenant_spread("steady") == {"a": 1}
    ledger.finished("a", at, "steady")
    assert "steady" not in ledger.by_tenant and ledger.tenant_spread("steady") == {}


def test_the_excess_is_past_the_even_split_and_zero_without_counts():
    def excess(*counts: int) -> list[int]:
        cands = [factories.cand(str(i), tenant_inflight=n) for i, n in enumerate(counts)]
        return list(tenant_excess(cands).values())

    assert excess(0, 0) == [0, 0] and excess(3, 3) == [0, 0]
    assert excess(4, 3) == [1, 0] and excess(5, 0) == [3, 0]
    assert excess(2, 1, 0) == [1, 0, 0]


def test_a_light_tenants_burst_spreads_across_two_equal_replicas():
    ledger = flooded_ledger()
    policy = PredictedTTFT()
    for k in range(6):  # "a"'s working set is the smaller: room alone sends the burst there
        policy.sent.record(factories.chain(b"old%d" % k, 4), "b", k + 1)
    burst = [decide(policy, ledger, "steady", factories.chain(b"s%d" % k, 4)) for k in range(8)]
    assert burst.count("a") == burst.count("b") == 4
    assert ledger.by_tenant["steady"] == {"a": 4, "b": 4}


def test_without_the_spread_room_would_pile_the_same_burst_on_one_replica():
    policy = PredictedTTFT()
    for k in range(6):
        policy.sent.record(factories.chain(b"old%d" % k, 4), "b", k + 1)
    burst = [policy.choose([cand("a"), cand("b")], factories.chain(b"s%d" % k, 4))
             for k in range(4)]
    assert {c.info.replica_id for c in burst} == {"a"}


def test_a_prefix_hit_still_goes_to_its_holder():
    for policy in (PredictedTTFT(), PrefixAware()):
        ledger = flooded_ledger()
        decide(policy, ledger, "steady", factories.chain(b"other", 4), {})  # within its split
        held = factories.chain(b"family", 4)
        holder = "b" if ledger.by_tenant["steady"].get("a") else "a"
        got = [decide(policy, ledger, "steady", held + [b"q%d" % k], {holder: 4}) for k in range(3)]
        # Past its even split there too: a copy is the bound's to make, not the spread's.
        assert got == [holder] * 3


def test_another_tenants_placement_is_unaffected():
    ledger = flooded_ledger()
    for _ in range(5):
        ledger.dispatched("a", "steady")
    # Tenant "other" has no request open: steady's five on "a" are not its counts.
    assert ledger.tenant_spread("other") == {}
    policy, twin = PredictedTTFT(), PredictedTTFT()
    for k in range(6):
        chain = factories.chain(b"o%d" % k, 4)
        assert decide(policy, ledger, "flood", chain) == \
            twin.choose([cand("a"), cand("b")], chain).info.replica_id


def test_ties_are_deterministic_whatever_the_candidates_order():
    even = [cand("a", tenant_inflight=2), cand("b", tenant_inflight=2)]
    chain = factories.chain(b"tie", 4)
    got = {PredictedTTFT().choose(order, chain).info.replica_id for order in (even, even[::-1])}
    got |= {PrefixAware().choose(order, chain).info.replica_id for order in (even, even[::-1])}
    assert len(got) == 1
    # A count breaks the tie the other way, in either order.
    loser = replace(even[0] if got == {even[0].info.replica_id} else even[1], tenant_inflight=3)
    other = next(c for c in even if c.info.replica_id != loser.info.replica_id)
    for order in ([loser, other], [other, loser]):
        assert PredictedTTFT().choose(order, chain) is other
        assert PrefixAware().choose(order, chain) is other


def test_the_router_builds_candidates_with_the_tenants_counts():
    from types import SimpleNamespace

    from kvfleet.router.auth import Authenticator
    from kvfleet.router.core import RouterCore

    ledger = flooded_ledger()
    ledger.dispatched("b", "steady")
    live = [(factories.info(rid), factories.report(at=100.0)) for rid in "ab"]
    replicas = SimpleNamespace(ledger=ledger, for_model=lambda model: live)
    core = RouterCore({}, "", replicas=replicas, policy=None,  # type: ignore[arg-type]
                      auth=Authenticator({}))
    try:
        counts = {c.info.replica_id: c.tenant_inflight for c in core._candidates("m", tenant="steady")}
        assert counts == {"a": 0, "b": 1}
        assert {c.tenant_inflight for c in core._candidates("m", tenant="flood")} == {0}
        assert {c.tenant_inflight for c in core._candidates("m")} == {0}  # no tenant: no spread
    finally:
        core.close()


def test_the_tenants_count_shows_in_the_decisions_description():
    assert " tenant=3 " in factories.cand("a", tenant_inflight=3).describe()
    assert "tenant=" not in factories.cand("a").describe()
