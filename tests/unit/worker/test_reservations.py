"""The worker's arrival count: exact limit, duplicate live ids, release."""

from __future__ import annotations

import pytest

from kvfleet.errors import AlreadyExists, ResourceExhausted
from kvfleet.worker.reservations import Reservations


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
