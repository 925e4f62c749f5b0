"""The load record's Redis fields: the forecast fields round-trip, and records of older
replicas (without them) still parse (rolling upgrade)."""

from __future__ import annotations

import pytest

from kvfleet.index_keys import LOAD_FIELDS, ReplicaLoad

NEW = ReplicaLoad(3, 1, 40, 64, 1.7e9, queue_delay_s=0.125, prefill_token_s=0.000625)


def test_fields_are_appended_in_order():
    assert LOAD_FIELDS == ("running", "waiting", "num_free_blocks", "num_total_blocks",
                           "updated_at", "queue_delay_s", "prefill_token_s",
                           "spec_drafted_tokens", "spec_accepted_tokens")
    assert len(NEW.to_fields()) == len(LOAD_FIELDS)


def test_new_record_round_trips():
    assert ReplicaLoad.from_fields(NEW.to_fields()) == NEW
    assert NEW.has_forecast


def test_old_records_parse_without_the_forecast():
    old = ["3", "1", "40", "64", "1700000000.0"]
    for values in (old, old + [None, None], old + [False, False], old + ["", ""]):
        load = ReplicaLoad.from_fields(values)
        assert load == ReplicaLoad(3, 1, 40, 64, 1.7e9) and not load.has_forecast
    no_forecast = ReplicaLoad(3, 1, 40, 64, 1.7e9)
    assert no_forecast.to_fields()[5:] == ["", "", "", ""]
    assert ReplicaLoad.from_fields(no_forecast.to_fields()) == no_forecast


def test_speculative_counts_round_trip_and_give_the_acceptance():
    load = ReplicaLoad(3, 1, 40, 64, 1.7e9, 0.1, 0.001, spec_drafted_tokens=80,
                       spec_accepted_tokens=60)
    assert ReplicaLoad.from_fields(load.to_fields()) == load
    assert load.spec_acceptance == 0.75
    assert NEW.spec_acceptance is None  # none advertised
    assert ReplicaLoad(3, 1, 40, 64, 1.7e9, spec_drafted_tokens=0,
                       spec_accepted_tokens=0).spec_acceptance is None  # none drafted


def test_missing_or_bad_records():
    assert ReplicaLoad.from_fields([None] * len(LOAD_FIELDS)) is None
    assert ReplicaLoad.from_fields([]) is None
    assert ReplicaLoad.from_fields(["3", "1", "40", None, "1.0", "0.1", "0.1"]) is None
    with pytest.raises(ValueError, match="load forecast"):
        ReplicaLoad.from_fields(["3", "1", "40", "64", "1.0", "-1", "0.1"])
    with pytest.raises(ValueError):
        ReplicaLoad.from_fields(["3", "1", "40", "64", "1.0", "soon", "0.1"])
