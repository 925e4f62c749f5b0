"""Issue 24 item 6: replicas advertise their model identity digest; a router never routes to
a replica whose identity it does not hold (another model directory, e.g. after ``kvfleet
upgrade --model-dir``), and says so: the UNAVAILABLE message, one log line per replica, and
``kvfleet status``."""

from __future__ import annotations

import asyncio
import logging

from kvfleet.deploy.registry_view import RegistryEntry
from kvfleet.deploy.status import format_status, replica_rows
from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.prefix_index import InMemoryPrefixIndex
from kvfleet.router.replica_set import ReplicaSet

LOAD = ReplicaLoad(running=0, waiting=0, num_free_blocks=64, num_total_blocks=64, updated_at=1.7e9)
MINE, THEIRS = "a1" * 16, "b2" * 16


def test_the_identity_survives_the_registry_json() -> None:
    info = ReplicaInfo("r", "127.0.0.1:1", "tiny", 2, 16, identity=MINE)
    assert ReplicaInfo.from_json("r", info.to_json(0.0)).identity == MINE


async def _replicas(*entries: tuple[str, str]) -> ReplicaSet:
    index = InMemoryPrefixIndex()
    for rid, identity in entries:
        pub = index.publisher(ReplicaInfo(rid, f"127.0.0.1:{len(rid)}", "tiny", 0, 16, identity=identity))
        await pub.register()
        await pub.heartbeat(LOAD)
    replicas = ReplicaSet(index, identities={"tiny": MINE})
    await replicas.refresh()
    return replicas


def test_a_replica_of_another_identity_is_never_routed_to_and_logged_once(caplog) -> None:
    async def scenario() -> None:
        replicas = await _replicas(("same", MINE), ("other", THEIRS), ("old", ""))
        with caplog.at_level(logging.WARNING, logger="kvfleet.router.replica_set"):
            for _ in range(3):
                assert [i.replica_id for i, _ in replicas.for_model("tiny")] == ["same"]
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 2 and any("other" in w and THEIRS[:16] in w for w in warned)
        assert set(replicas.foreign) == {"other", "old"}

    asyncio.run(scenario())


def test_only_foreign_replicas_make_unavailable_say_why() -> None:
    async def scenario() -> None:
        replicas = await _replicas(("other", THEIRS))
        assert replicas.for_model("tiny") == []
        reason = replicas.none_reason("tiny")
        assert MINE[:16] in reason and THEIRS[:16] in reason and "1 replica(s)" in reason
        assert replicas.none_reason("absent") == "no live replica serves model 'absent'"

    asyncio.run(scenario())


def test_kvfleet_status_flags_a_replica_the_routers_do_not_route_to() -> None:
    entries = [RegistryEntry(ReplicaInfo(rid, "127.0.0.1:1", "m", 1, 16, serve_replica=rid,
                                         identity=ident), LOAD, 0.1)
               for rid, ident in (("m-new", THEIRS), ("m-old", MINE))]
    rows = replica_rows([{"replica_id": "m-new", "state": "RUNNING"},
                         {"replica_id": "m-old", "state": "RUNNING"}], entries, tp=1)
    assert {r["replica_id"]: r["identity"] for r in rows} == {"m-new": THEIRS, "m-old": MINE}
    status = {"applications": [{"app": "ns.m", "model": "m", "revision": "", "serve_status": "RUNNING",
                                "target_replicas": 2, "replicas": rows}],
              "routers": [{"router_id": "r1", "address": "x:1", "policy": "prefix_aware", "pid": 1,
                           "model": "m", "identity": MINE}],
              "redis": {"address": "127.0.0.1:6379", "up": True}}
    text = format_status(status)
    flagged = [line for line in text.splitlines() if "IDENTITY MISMATCH" in line]
    assert len(flagged) == 1 and "m-new" in flagged[0] and THEIRS[:16] in flagged[0]
