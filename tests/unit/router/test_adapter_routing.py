"""The router's view of LoRA adapters: the revision it hashes with, who serves it, the
preference for replicas where it is resident, and what ListModels reports."""

import pytest

from kvfleet.errors import NotFound
from kvfleet.index_keys import ReplicaInfo
from kvfleet.router.adapter_routing import adapter_revision, prefer_resident, served_adapters, serving
from kvfleet.router.policy import Candidate
from tests.unit.router import factories

info = factories.info


def cand(i: ReplicaInfo, running: int = 0, matched: int = 0) -> Candidate:
    return factories.cand(i, matched, running=running)


def test_the_revision_most_replicas_serve_is_hashed_and_unknown_is_not_found() -> None:
    live = [info("a", [("sql", "r1")]), info("b", [("sql", "r2")]), info("c", [("sql", "r2")])]
    assert adapter_revision(live, "sql", "m") == "r2"
    with pytest.raises(NotFound, match="adapter 'chat' is not served for model 'm'"):
        adapter_revision(live, "chat", "m")
    assert [c.info.replica_id for c in serving([cand(i) for i in live], ("sql", "r2"))] == ["b", "c"]


def test_prefix_aware_prefers_resident_replicas_unless_much_busier() -> None:
    cold, warm = info("cold", [("sql", "r")]), info("warm", [("sql", "r")], resident=["sql"])
    picked = prefer_resident([cand(cold), cand(warm, running=2)], "sql")
    assert [c.info.replica_id for c in picked] == ["warm"]
    both = prefer_resident([cand(cold), cand(warm, running=3)], "sql")  # 3 > slack of 2
    assert [c.info.replica_id for c in both] == ["cold", "warm"]
    holder = prefer_resident([cand(cold, matched=2), cand(warm)], "sql")  # a prefix holder stays
    assert {c.info.replica_id for c in holder} == {"cold", "warm"}
    nobody = prefer_resident([cand(cold), cand(info("x", [("sql", "r")]))], "sql")
    assert len(nobody) == 2


def test_served_adapters_counts_replicas_and_residency() -> None:
    live = [info("a", [("sql", "r1"), ("chat", "c")], resident=["sql"]),
            info("b", [("sql", "r1")])]
    assert served_adapters(live) == [
        {"name": "chat", "revision": "c", "replicas": 1, "resident_replicas": 0},
        {"name": "sql", "revision": "r1", "replicas": 2, "resident_replicas": 1}]


def test_registry_json_round_trips_the_adapter_fields() -> None:
    i = info("a", [("sql", "r1")], resident=["sql"])
    assert ReplicaInfo.from_json("a", i.to_json(0.0)) == i
    assert ReplicaInfo.from_json("a", info("a").to_json(0.0)).adapters == ()
