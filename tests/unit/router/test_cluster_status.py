"""Router.ClusterStatus over registry entries written by other versions of the worker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvfleet.index_keys import ReplicaInfo
from kvfleet.router.server import RouterService


def test_rank_fields_this_router_does_not_know_are_ignored() -> None:
    # Issue 24 item 20: RankStatus(**rank) raised on a field from a newer worker.
    rank = {"rank": 0, "num_blocks": 64, "kv_bytes": 1 << 20, "a_field_from_the_future": 7}
    info = ReplicaInfo("rep-a", "127.0.0.1:1", "tiny", 1, 16, ranks=(rank,))
    async def refresh() -> None:  # ClusterStatus reads the registry first
        return None

    core = SimpleNamespace(policy=SimpleNamespace(name="prefix_aware"),
                           replicas=SimpleNamespace(index_available=True, refresh=refresh,
                                                    replicas={"rep-a": (info, None)}))
    out = asyncio.run(RouterService(core).ClusterStatus(None, None))
    (replica,) = out.replicas
    assert (replica.ranks[0].num_blocks, replica.ranks[0].kv_bytes) == (64, 1 << 20)
