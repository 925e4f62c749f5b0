"""The edges of a peer pull: ``ExportBlocks`` requests are checked and name the bad field; a
hint from the wire; the relay copies every rank's shard from another node's tier."""

import asyncio
import types

import numpy as np
import pytest

from kvfleet.errors import InvalidArgument, Unavailable
from kvfleet.v1 import worker_pb2
from kvfleet.worker.kv_tier.peer_client import NodeRelay
from kvfleet.worker.kv_tier.peer_pull import PeerHint, PullCost
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.service.engine_loop import EngineLoop
from kvfleet.worker.service.peer_export import (
    MAX_EXPORT_BLOCKS,
    MAX_EXPORT_TIMEOUT_S,
    export_blocks,
    export_hashes,
)


def test_export_requests_are_checked():
    chain = [bytes([i]) * 16 for i in range(3)]
    ok = worker_pb2.ExportBlocksRequest(block_hashes=chain, timeout_s=1.0)
    assert export_hashes(ok) == tuple(chain)
    many = [i.to_bytes(16, "big") for i in range(MAX_EXPORT_BLOCKS + 1)]
    bad = [worker_pb2.ExportBlocksRequest(),
           worker_pb2.ExportBlocksRequest(block_hashes=many),
           worker_pb2.ExportBlocksRequest(block_hashes=[bytes(16), b"short"]),
           # A chain never repeats a hash (each is keyed by its parent's).
           worker_pb2.ExportBlocksRequest(block_hashes=[chain[0], chain[1], chain[0]]),
           worker_pb2.ExportBlocksRequest(block_hashes=chain, timeout_s=-1),
           worker_pb2.ExportBlocksRequest(block_hashes=chain, timeout_s=float("nan")),
           worker_pb2.ExportBlocksRequest(block_hashes=chain, timeout_s=float("inf"))]
    for req, field in zip(bad, ["block_hashes"] * 4 + ["timeout_s"] * 3, strict=True):
        with pytest.raises(InvalidArgument) as err:
            export_hashes(req)
        assert err.value.field == field


def test_a_hint_from_the_wire():
    msg = worker_pb2.WorkerGenerateRequest()
    assert PeerHint.from_proto(msg.peer) is None
    msg.peer.replica_id, msg.peer.address, msg.peer.num_blocks = "a", "h:1", 4
    assert PeerHint.from_proto(msg.peer) == PeerHint("a", "h:1", 4, 0)
    msg.peer.address = ""
    with pytest.raises(InvalidArgument, match="peer.address"):
        PeerHint.from_proto(msg.peer)
    msg.peer.address, msg.peer.first_block = "h:1", -1
    with pytest.raises(InvalidArgument, match="peer.num_blocks"):
        PeerHint.from_proto(msg.peer)


def test_the_relay_copies_every_ranks_shard_or_fails():
    source, local = HostTierStore(1 << 20), HostTierStore(1 << 20)
    hashes = [b"h%015d" % i for i in range(3)]
    for rank in (0, 1):
        source.put(rank, hashes, np.full((3, 8), rank, dtype=np.uint8))
    relay = NodeRelay(local, [0, 1])
    assert relay.copy(source, hashes) == 3
    assert local.lookup(hashes, [0, 1]) == 3 and local.get(1, hashes).max() == 1
    with pytest.raises(LookupError):
        relay.copy(source, hashes + [b"missing-block-00"])


def test_the_pull_cost_learns_from_what_pulls_take():
    cost = PullCost(block_bytes=1000, overhead_s=0.01, seconds_per_byte=1e-6, alpha=0.5)
    assert cost.predict_s(10) == pytest.approx(0.02)
    cost.observe(10, 0.01 + 10 * 1000 * 3e-6)  # three times slower than predicted
    assert cost.seconds_per_byte == pytest.approx(2e-6)


class _RecordingLoop:
    """An engine loop stand-in that records the wait it was given and exports nothing."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def export_blocks(self, hashes, timeout_s):
        self.waits.append(timeout_s)
        return ()


def test_an_exports_wait_is_capped():
    """A caller without a deadline asking for a huge (finite) wait cannot hold the handler
    for longer than ``MAX_EXPORT_TIMEOUT_S``."""
    loop = _RecordingLoop()
    req = worker_pb2.ExportBlocksRequest(block_hashes=[bytes(16)], timeout_s=1e9)
    resp = asyncio.run(export_blocks(loop, req, "n", None))  # type: ignore[arg-type]
    assert list(resp.block_hashes) == [] and loop.waits == [MAX_EXPORT_TIMEOUT_S]
    asyncio.run(export_blocks(loop, worker_pb2.ExportBlocksRequest(block_hashes=[bytes(16)]),
                              "n", 2.0))  # type: ignore[arg-type]
    assert loop.waits[-1] == 2.0


def test_an_export_from_a_stopped_engine_loop_is_unavailable():
    """The engine thread is not running: the export is refused at once, not left to wait."""
    engine = types.SimpleNamespace(stats=dict)

    async def export():
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        with pytest.raises(Unavailable, match="engine thread"):
            await loop.export_blocks((bytes(16),), 0.05)

    asyncio.run(export())
