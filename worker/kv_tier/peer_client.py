"""How a replica reaches a peer for a prefix pull: ``Worker.ExportBlocks`` over gRPC, a node's
host tier as the peer (:class:`TierPeer`: blocks a drained replica handed over), and the copy of
blocks held in another node's host tier into this node's (:class:`NodeRelay`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import grpc

from kvfleet.allocator.kv_cache_manager import group_key
from kvfleet.index_keys import tier_node
from kvfleet.tls import WORKER_CHANNEL_OPTIONS
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.kv_tier.peer_pull import Exported, PeerHint
from kvfleet.worker.kv_tier.store import TierStore

MAX_CHANNELS = 16  # peers this replica keeps a channel open to (least recently used closed)
# The only methods a replica's certificate may call on a peer (kvfleet.grpc_auth).
PEER_METHODS = frozenset({
    f"/{worker_pb2.DESCRIPTOR.services_by_name['Worker'].full_name}/ExportBlocks"})


class GrpcPeerClient:
    """:class:`~.peer_pull.PeerClient` over gRPC: plaintext, or with internal TLS the
    ``credentials()`` of the replica certificate (read for each new channel, so a renewal
    applies; peers let it call ``ExportBlocks`` only). One channel per peer address, at most
    ``max_channels`` open."""

    def __init__(self, max_channels: int = MAX_CHANNELS,
                 credentials: Optional[Callable[[], grpc.ChannelCredentials]] = None) -> None:
        self.max_channels = max_channels
        self.credentials = credentials
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, self.credentials(),
                                       options=WORKER_CHANNEL_OPTIONS)

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.pop(address, None) or self._channel(address)
        self._channels[address] = channel
        while len(self._channels) > self.max_channels:
            _, old = self._channels.popitem(last=False)
            asyncio.ensure_future(old.close())
        return worker_pb2_grpc.WorkerStub(channel)

    async def export(self, hint: PeerHint, hashes: Sequence[bytes], timeout_s: float) -> Exported:
        """Ask ``hint.address`` to export ``hashes``; its answer.

        Raises:
            grpc.aio.AioRpcError: the peer refused, failed, or did not answer in time.
        """
        req = worker_pb2.ExportBlocksRequest(block_hashes=list(hashes), timeout_s=timeout_s)
        resp = await self._stub(hint.address).ExportBlocks(req, timeout=timeout_s)
        return Exported(tuple(resp.block_hashes), resp.node_id)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), OrderedDict()
        for channel in channels:
            await channel.close()


class NodeRelay:
    """Copies blocks from another node's host tier into ``local`` (this node's), every rank's
    shard (``ranks``), each call bounded by the tiers' own timeouts; they are kept with ``tag``
    (the receiver's identity: the puller asked for them by its own chain)."""

    def __init__(self, local: TierStore, ranks: Sequence[int], tag: bytes = b"",
                 num_groups: int = 1) -> None:
        self.local, self.ranks, self.tag = local, list(ranks), tag
        self.num_groups = num_groups  # the KV cache's layer groups: each one's pages travel

    def source(self, node_id: str) -> TierStore:
        """The same deployment's tier on ``node_id``, seen through the same layout
        (``local.on_node``: a :class:`~.tier_layout.LayoutTier` over a node tier). Raises
        ValueError (Ray's) when that node has none."""
        return self.local.on_node(node_id)  # type: ignore[attr-defined]

    def copy(self, source: TierStore, hashes: Sequence[bytes]) -> int:
        """Copy ``hashes`` of every rank from ``source``, with layer groups also the other
        groups' pages of them that ``source`` holds for every rank; returns the blocks copied.

        Raises:
            LookupError: ``source`` no longer holds them all.
        """
        keys = list(hashes)
        if self.num_groups > 1:
            pages = [group_key(g, h) for g in range(1, self.num_groups) for h in hashes]
            keys += [k for k, held in zip(pages, source.held(pages, self.ranks), strict=True)
                     if held]
        for rank in self.ranks:
            run = source.get(rank, keys)
            if run is None:
                raise LookupError(f"rank {rank}'s blocks left the source tier")
            self.local.put(rank, keys, run, self.tag)
        return len(hashes)

    async def __call__(self, node_id: str, hashes: Sequence[bytes]) -> int:
        return await asyncio.to_thread(lambda: self.copy(self.source(node_id), hashes))


class TierPeer:
    """:class:`~.peer_pull.PeerClient` for a hint naming a node's host tier
    (``PeerHint.tier_id``): the "export" is the leading run of the asked hashes that tier
    holds for every rank in ``ranks`` (``source(node id)``: that node's tier, e.g.
    :meth:`NodeRelay.source`); the puller then copies them with its relay and restores them
    like any pulled block. Nothing is exported by a replica, so no engine is involved.

    The hashes asked are the receiver's own chain for the request (identity, tenant scope,
    salt), and the tier stores blocks under the chain hash that produced them: a tier holding
    the same tokens under another tenant's or model's chain answers none of them.
    """

    def __init__(self, source: Callable[[str], TierStore], ranks: Sequence[int]) -> None:
        self.source, self.ranks = source, list(ranks)

    async def export(self, hint: PeerHint, hashes: Sequence[bytes], timeout_s: float) -> Exported:
        """The run of ``hashes`` the hinted tier holds, and its node.

        Raises:
            ValueError: ``hint.tier_id`` is not a tier id. Anything the tier's lookup raises
                (a dead or slow actor; the caller bounds the wait by ``timeout_s``).
        """
        node = tier_node(hint.tier_id)

        def held() -> int:
            return self.source(node).lookup(list(hashes), self.ranks)

        return Exported(tuple(hashes[:await asyncio.to_thread(held)]), node)

    async def close(self) -> None:
        """Nothing to release."""
