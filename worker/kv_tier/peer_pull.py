"""The receiving side of a replica-to-replica prefix pull (docs/kv_tier.md, "Peer pull").

The router routed a request here although replica A holds more of its prefix (a
:class:`PeerHint`). Before the request reaches the engine, :meth:`PeerPuller.prepare` decides
whether pulling A's blocks beats recomputing them — the predicted pull time
(:class:`PullCost`: a fixed part plus bytes moved, corrected by every pull) against the
prefill time the step-cost model predicts for those tokens — and if so asks A to export them
(:class:`PeerClient`): A writes them to its node's host tier, and the engine here then restores
them at admission exactly like any other tier hit (one restore path). The pull names the
blocks by this replica's own chain hashes for the request's tokens; A answers with the hashes
its blocks are registered under, and a mismatch is refused (the request then skips the tier
and recomputes). A pull that fails or takes longer than the recompute it would save is given
up: the request recomputes; a pull never fails a request.

A hint may name a node's host tier instead of a replica (``PeerHint.tier_id``: blocks a
drained replica handed over to its node's tier): the same decision, verification
and relay, with the tier as the "peer" (``tiers``: a
:class:`~kvfleet.worker.kv_tier.peer_client.TierPeer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, NamedTuple, Optional, Protocol, Sequence

import grpc

from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.errors import InvalidArgument
from kvfleet.index_keys import tier_node
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.step_cost.model import StepCostModel, attended

log = logging.getLogger(__name__)
MAX_PULL_TIMEOUT_S = 5.0
MIN_PULL_TIMEOUT_S = 0.25  # a short prefix's recompute time would time out any real call


@dataclass(frozen=True)
class PeerHint:
    """Replica ``replica_id`` (Worker service at ``address``) holds the first ``num_blocks``
    blocks of the request's chain; this replica holds ``first_block`` of them. With
    ``tier_id`` (and no address) the holder is that node's host tier, not a replica (blocks
    a drained replica handed over)."""

    replica_id: str
    address: str
    num_blocks: int
    first_block: int = 0
    tier_id: str = ""

    @classmethod
    def from_proto(cls, msg) -> Optional["PeerHint"]:
        """The hint of a ``WorkerGenerateRequest.peer`` (None when unset or empty).

        Raises:
            InvalidArgument: a negative count, blocks without an address or tier, a tier id
                that is none (``tier:<node>``), or both an address and a tier.
        """
        if msg.num_blocks == 0 and not (msg.address or msg.tier_id):
            return None
        if msg.num_blocks < 0 or msg.first_block < 0:
            raise InvalidArgument("peer.num_blocks and peer.first_block must be >= 0",
                                  field="peer.num_blocks")
        if msg.tier_id:
            try:
                tier_node(msg.tier_id)
            except ValueError as exc:
                raise InvalidArgument(str(exc), field="peer.tier_id") from None
            if msg.address:
                raise InvalidArgument("peer names both an address and a tier",
                                      field="peer.tier_id")
        elif not msg.address:
            raise InvalidArgument("peer.address is required with peer.num_blocks", field="peer.address")
        return cls(msg.replica_id, msg.address, msg.num_blocks, msg.first_block, msg.tier_id)


class Exported(NamedTuple):
    """A peer's answer: the hashes of the blocks it exported (in chain order) and the Ray
    node whose host tier holds them."""

    hashes: tuple[bytes, ...]
    node_id: str


class PeerClient(Protocol):
    """How a replica asks a peer to export blocks (gRPC ``Worker.ExportBlocks``; in-process
    in tests). May raise anything: the puller treats every failure as "recompute"."""

    async def export(self, hint: PeerHint, hashes: Sequence[bytes],
                     timeout_s: float) -> Exported: ...

    async def close(self) -> None:
        """Release connections (idempotent)."""


# Copies a peer node's blocks into this node's tier: (source node, hashes) -> blocks copied.
Relay = Callable[[str, Sequence[bytes]], Awaitable[int]]


@dataclass
class PullCost:
    """Predicted seconds of one pull: ``overhead_s`` + ``seconds_per_byte`` × bytes (of rank
    0's shard). The seed is the default model's measurement in docs/kv_tier.md (snapshot +
    put + restore of 64 blocks); every pull that lands moves ``seconds_per_byte`` towards the
    wait it measured (export and put; the restore after it is left out), weight ``alpha``."""

    block_bytes: int
    overhead_s: float = 0.02
    seconds_per_byte: float = 5.2e-9
    alpha: float = 0.2

    def predict_s(self, num_blocks: int) -> float:
        return self.overhead_s + self.seconds_per_byte * self.block_bytes * num_blocks

    def observe(self, num_blocks: int, seconds: float) -> None:
        if num_blocks <= 0 or self.block_bytes <= 0:
            return
        measured = max(0.0, seconds - self.overhead_s) / (self.block_bytes * num_blocks)
        self.seconds_per_byte += self.alpha * (measured - self.seconds_per_byte)


@dataclass
class PullStats:
    """Counters of one replica's pulls (blocks; seconds as floats)."""

    pulls: int = 0          # pulls that landed (at least one block)
    pulled_blocks: int = 0
    pull_s: float = 0.0     # their seconds in all
    skipped: int = 0        # hints not worth a pull (too few blocks, recompute cheaper)
    refused: int = 0        # answers whose hashes did not match this replica's chain
    empty: int = 0          # answered with no block (the peer no longer held them): recomputed
    failed: int = 0         # the peer failed, timed out or was unreachable
    timed_out: int = 0      # of those failed: past the pull's timeout (its own or the RPC's)


class PeerPuller:
    """Pulls hinted prefixes for one replica.

    Args:
        client: asks a peer to export.
        step_cost: this replica's step-cost model (the recompute side of the decision).
        identity_digest: the served model's identity (the chain's root of a base-model
            request).
        block_size, max_batched_tokens: the engine's (prefill runs in chunks of the latter).
        cost: the pull side of the decision.
        node_id: this replica's Ray node; ``relay`` copies an export that landed in another
            node's tier into this node's (None: such a pull counts as failed).
        min_timeout_s, max_timeout_s: bounds of a pull's wait, which is otherwise the
            predicted recompute time.
        tiers: answers a hint that names a node tier instead of a replica (:class:`TierPeer
            <kvfleet.worker.kv_tier.peer_client.TierPeer>`); None: such hints are skipped.
        adapter_digest: the chain root's identity digest of a request for an adapter (its
            name → the model's identity with the revision served now); None: adapter
            requests are not pulled. The revision is pinned again at admission: if it changed
            in between, the pulled blocks are under the old revision's hashes and simply miss.
    """

    def __init__(self, client: PeerClient, step_cost: StepCostModel, identity_digest: bytes,
                 block_size: int, max_batched_tokens: int, cost: PullCost,
                 node_id: str = "", relay: Optional[Relay] = None,
                 max_timeout_s: float = MAX_PULL_TIMEOUT_S,
                 min_timeout_s: float = MIN_PULL_TIMEOUT_S,
                 tiers: Optional[PeerClient] = None,
                 adapter_digest: Optional[Callable[[str], bytes]] = None) -> None:
        self.client, self.step_cost, self.cost = client, step_cost, cost
        self.adapter_digest = adapter_digest
        self.tiers = tiers
        self.identity_digest, self.node_id, self.relay = identity_digest, node_id, relay
        self.block_size, self.max_batched_tokens = block_size, max_batched_tokens
        self.max_timeout_s, self.min_timeout_s = max_timeout_s, min_timeout_s
        self.stats = PullStats()

    def recompute_s(self, first_block: int, num_blocks: int) -> float:
        """Predicted prefill seconds of ``num_blocks`` blocks after ``first_block`` cached
        ones, in chunks of ``max_batched_tokens``."""
        start, left, total = first_block * self.block_size, num_blocks * self.block_size, 0.0
        while left > 0:
            chunk = min(left, self.max_batched_tokens)
            total += self.step_cost.predict_step_s(0, chunk, attended(start, chunk))
            start, left = start + chunk, left - chunk
        return total

    async def prepare(self, req: EngineRequest, hint: Optional[PeerHint]) -> EngineRequest:
        """Pull ``hint``'s blocks for ``req`` when that beats recomputing them; returns the
        request to run (``tier_skip`` set when the peer's answer was refused). Never raises
        for a failed pull."""
        if hint is None or req.tier_skip or (req.adapter and self.adapter_digest is None):
            return req
        client = self.tiers if hint.tier_id else self.client
        limit = min(hint.num_blocks, (len(req.prompt_token_ids) - 1) // self.block_size)
        first = min(hint.first_block, limit)
        recompute_s = self.recompute_s(first, limit - first)
        if (client is None or limit - first <= 0
                or self.cost.predict_s(limit - first) >= recompute_s):
            self.stats.skipped += 1
            return req
        digest = self.identity_digest
        try:
            if req.adapter and self.adapter_digest is not None:
                digest = self.adapter_digest(req.adapter)
        except Exception:  # an adapter not served here: admission refuses it, nothing to pull
            self.stats.skipped += 1
            return req
        root = root_hash(digest, req.cache_scope or req.tenant, req.cache_salt)
        chain = block_hash_chain(root, req.prompt_token_ids[:limit * self.block_size],
                                 self.block_size)
        wanted = tuple(chain[first:limit])
        # Past the recompute time recomputing was faster (within the bounds).
        timeout_s = min(max(recompute_s, self.min_timeout_s), self.max_timeout_s)
        start = time.perf_counter()
        try:
            got = await asyncio.wait_for(self._pull(client, hint, wanted, timeout_s), timeout_s)
        except Exception as exc:  # any failure: recompute
            log.warning("pull of %d blocks from %s failed: %s", len(wanted), _source(hint),
                        f"{type(exc).__name__}: {exc}")
            self.stats.failed += 1
            self.stats.timed_out += _is_timeout(exc)
            return req
        if got is None:
            self.stats.refused += 1
            log.warning("pull from %s refused: its block hashes differ from this replica's "
                        "chain", _source(hint))
            return dataclasses.replace(req, tier_skip=True)
        seconds = time.perf_counter() - start
        if not got:  # the peer no longer held them (or its write-back was dropped)
            self.stats.empty += 1
            return req
        self.stats.pulls += 1
        self.stats.pulled_blocks += got
        self.stats.pull_s += seconds
        self.cost.observe(got, seconds)
        return req

    async def _pull(self, client: PeerClient, hint: PeerHint, wanted: tuple[bytes, ...],
                    timeout_s: float) -> Optional[int]:
        """Blocks pulled into this node's tier; None when the answer does not match
        ``wanted`` (a leading run of it, hash for hash)."""
        exported = await client.export(hint, wanted, timeout_s)
        hashes = tuple(exported.hashes)
        if len(hashes) > len(wanted) or hashes != wanted[:len(hashes)]:
            return None
        if hashes and exported.node_id and self.node_id and exported.node_id != self.node_id:
            if self.relay is None:
                raise RuntimeError(f"blocks landed on node {exported.node_id}, no relay")
            await self.relay(exported.node_id, hashes)
        return len(hashes)  # the peer answers only blocks in the tier for every rank


def _is_timeout(exc: BaseException) -> bool:
    """The pull's own bound, or the export RPC's deadline."""
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)


def _source(hint: PeerHint) -> str:
    return hint.tier_id or hint.replica_id
