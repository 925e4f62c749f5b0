"""Router-side refusal: a replica at its advertised limit has no room; all at it → refused."""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.errors import ResourceExhausted
from kvfleet.router.capacity import check_room, check_tenant, fleet_capacity, has_room, with_room
from kvfleet.router.policy import Candidate
from tests.unit.router import factories


def cand(rid: str, limit: int, **load) -> Candidate:
    return factories.cand(rid, limit=limit, at=1.0, **load)


def test_room_is_load_below_the_advertised_limit():
    assert has_room(cand("a", 6, running=2, waiting=3))
    assert not has_room(cand("a", 6, running=2, waiting=4))
    assert not has_room(cand("a", 6, inflight=6))  # this router's own streams count at once
    assert has_room(cand("a", 0, running=100))  # no advertised limit: the worker decides


def test_only_candidates_with_room_are_routed_to_unless_none_has():
    full, free = cand("a", 2, running=2), cand("b", 2, running=1)
    assert with_room([full, free]) == [free]
    assert with_room([full]) == [full]


def test_every_candidate_full_is_refused_naming_the_limits():
    check_room([cand("a", 2, running=2), cand("b", 3)], "m")  # b has room
    with pytest.raises(ResourceExhausted, match="'m' is at its limit of 2/3 running"):
        check_room([cand("a", 2, running=2), cand("b", 3, waiting=3)], "m")


def _waiting(rid: str, bound: float, delay: float) -> Candidate:
    """A candidate with room in sequences whose forecast queue delay is ``delay`` s against
    its advertised queue bound."""
    entry = dataclasses.replace(factories.info(rid, limit=64), max_queue_wait_s=bound)
    return factories.cand(entry, running=2, waiting=5, at=1.0, delay=delay, per_token=0.001)


def test_a_replica_whose_forecast_passed_its_queue_bound_has_no_room():
    assert has_room(_waiting("a", 60.0, 59.0)) and not has_room(_waiting("a", 60.0, 61.0))
    assert has_room(_waiting("a", 0.0, 500.0))  # no bound advertised: the worker decides
    with pytest.raises(ResourceExhausted, match=r"queue bound of 60 s \(max_queue_wait_s\)"):
        check_room([_waiting("a", 60.0, 61.0), cand("b", 2, running=2)], "m")


def test_a_tenant_at_its_limit_is_refused_and_the_fleet_capacity_is_the_sum_of_limits():
    assert fleet_capacity([cand("a", 6), cand("b", 4)]) == 10
    assert fleet_capacity([cand("a", 6), cand("b", 0)]) == 0  # one unknown: unknown
    check_tenant("acme", 4, 5)
    check_tenant("acme", 400, None)  # no limit
    with pytest.raises(ResourceExhausted, match="tenant 'acme' is at its limit of 5 in-flight"):
        check_tenant("acme", 5, 5)


def test_tenant_max_inflight_caps_tenants_without_their_own_limit():
    from kvfleet.router.auth import Authenticator
    from kvfleet.router.core import RouterCore

    auth = Authenticator({"k1": "acme", "k2": "globex"}, tenant_limits={"acme": 50},
                         default_tenant_share=0.5)
    core = RouterCore({}, "", replicas=None, policy=None, auth=auth,  # type: ignore[arg-type]
                      tenant_max_inflight=8)
    try:
        fleet = [cand("a", 12), cand("b", 12)]  # 24 in all: half is 12
        assert core.tenant_limit("acme", fleet) == 50  # its own limit wins
        assert core.tenant_limit("globex", fleet) == 8  # min(12, 8)
        assert core.tenant_limit("globex", [cand("a", 0)]) == 8  # capacity unknown: the flag
        core.tenant_max_inflight = None
        assert core.tenant_limit("globex", fleet) == 12
    finally:
        core.close()
