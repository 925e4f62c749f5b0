"""ReplicaSet's view of the registry when the only replica drains and a replacement registers
between two periodic reads."""

from __future__ import annotations

import asyncio
import dataclasses

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.prefix_index import InMemoryPrefixIndex
from kvfleet.router.replica_set import ReplicaSet

LOAD = ReplicaLoad(running=0, waiting=0, num_free_blocks=64, num_total_blocks=64, updated_at=1.7e9)


def test_routable_rereads_the_registry_when_its_view_has_no_routable_replica() -> None:
    async def scenario() -> None:
        index = InMemoryPrefixIndex()
        old = index.publisher(ReplicaInfo("old", "127.0.0.1:6001", "tiny", 0, 16))
        await old.register()
        await old.heartbeat(LOAD)
        replicas = ReplicaSet(index)  # no background task: reads only when told
        await replicas.refresh()
        assert [i.replica_id for i, _ in replicas.for_model("tiny")] == ["old"]

        old.replica = dataclasses.replace(old.replica, state="draining")
        await old.heartbeat(LOAD)
        await replicas.refresh()  # the periodic read sees the drain ...
        await old.deregister()
        await replicas.refresh()  # ... then an empty registry: the last-known list is kept
        assert replicas.for_model("tiny") == [] and "old" in replicas.replicas

        new = index.publisher(ReplicaInfo("new", "127.0.0.1:6002", "tiny", 0, 16))
        await new.register()
        await new.heartbeat(LOAD)
        assert replicas.for_model("tiny") == []  # the view is stale until the next read
        assert [i.replica_id for i, _ in await replicas.routable("tiny")] == ["new"]

        index.available = False  # an outage: nothing is read, nothing raised
        replicas.mark_index_down(RuntimeError("down"))
        assert await replicas.routable("other-model") == []

    asyncio.run(scenario())


def test_state_of_replaced_replicas_is_pruned() -> None:
    # Issue 24 item 18: every Serve replacement left a channel, ledger entries and a mark.
    async def scenario() -> None:
        index = InMemoryPrefixIndex()
        replicas = ReplicaSet(index, empty_grace_s=0.0)
        for i in range(50):
            pub = index.publisher(ReplicaInfo(f"rep-{i}", f"127.0.0.1:{7000 + i}", "tiny", 0, 16))
            await pub.register()
            await pub.heartbeat(LOAD)
            await replicas.refresh()
            (info, _), = replicas.for_model("tiny")
            replicas.link(info)  # a channel, never connected
            replicas.ledger.finished(info.replica_id, replicas.ledger.dispatched(info.replica_id))
            replicas.mark_unreachable(info)
            await pub.deregister()
        await replicas.refresh()
        assert replicas.replicas == {}
        assert replicas._channels == {} and replicas._unreachable == {}
        assert dict(replicas.ledger.inflight) == {}
        await replicas.close()

    asyncio.run(scenario())
