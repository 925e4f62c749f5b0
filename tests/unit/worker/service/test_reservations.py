"""The worker's arrival count: exact limit, duplicate live ids, release."""

from __future__ import annotations

import pytest

from kvfleet.errors import AlreadyExists, ResourceExhausted
from kvfleet.worker.service.reservations import Reservations


def test_takes_up_to_the_limit_in_sequences_then_refuses_naming_it():
    r = Reservations(limit=4)
    r.take("a", 3)
    r.take("b", 1)
    with pytest.raises(ResourceExhausted, match="limit of 4 running \\+ waiting sequences"):
        r.take("c", 1)
    assert r.count == 4 and "c" not in r
    r.release("a")
    r.take("c", 2)  # room again once a request left
    assert r.count == 3


def test_a_live_id_is_refused_and_free_again_after_release():
    r = Reservations(limit=8)
    r.take("req-1")
    with pytest.raises(AlreadyExists, match="req-1"):
        r.take("req-1")
    assert r.count == 1
    r.release("req-1")
    r.release("req-1")  # idempotent: a second release frees nothing more
    assert r.count == 0
    r.take("req-1")
    assert "req-1" in r


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit"):
        Reservations(0)


def test_a_tenant_share_refuses_the_flooding_tenant_and_keeps_room_for_others():
    r = Reservations(limit=6, tenant_share=0.5)
    for i in range(3):
        r.take(f"a{i}", tenant="acme")
    with pytest.raises(ResourceExhausted, match="tenant 'acme' holds its share"):
        r.take("a3", tenant="acme")
    for i in range(3):
        r.take(f"g{i}", tenant="globex")  # the other half stays open to another tenant
    assert r.count == 6 and r.held_by("acme") == r.held_by("globex") == 3
    r.release("a0")
    r.take("a3", tenant="acme")
    assert r.held_by("acme") == 3
