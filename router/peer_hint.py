"""The peer hint a routed request carries (docs/kv_tier.md, "Peer pull"; across nodes too): when
the chosen replica reaches less of the prompt's prefix than another live replica holds (the
policy traded the match for load), or than a node's host tier holds (blocks a drained replica
handed over to its node's tier, on a node the chosen replica is not on), the worker request
names that source and both matches, and the chosen replica may pull the difference from it
instead of recomputing (``worker/kv_tier/peer_pull.py``).

The choice (:func:`pick_source`) is a pure function of the routing decision's candidates and
the tiers' leading runs, so the fleet simulator can make it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from kvfleet.router.policy import Candidate
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.v1 import worker_pb2

MIN_HINT_BLOCKS = 1  # blocks the source must hold beyond what the chosen replica reaches


@dataclass(frozen=True)
class PeerSource:
    """Where the chosen replica may pull from: a live replica (``replica_id`` at ``address``)
    or a node's host tier (``tier_id``), holding the chain's first ``num_blocks`` blocks."""

    num_blocks: int
    replica_id: str = ""
    address: str = ""
    tier_id: str = ""


def best_holder(candidates: Sequence[Candidate], chosen: Candidate,
                min_blocks: int = MIN_HINT_BLOCKS) -> Optional[Candidate]:
    """The candidate holding the most leading blocks, if it is not ``chosen`` and holds at
    least ``min_blocks`` more than ``chosen`` reaches itself — its device match plus the
    blocks its node tier holds after it, which it restores without a pull (ties: the first
    listed); else None. Only a replica of the same identity matches blocks at all (the
    chain's root is keyed by it)."""
    others = [c for c in candidates if c.info.replica_id != chosen.info.replica_id]
    if not others:
        return None
    holder = max(others, key=lambda c: c.matched_blocks)
    if holder.matched_blocks - (chosen.matched_blocks + chosen.host_blocks) < min_blocks:
        return None
    return holder


def pick_source(candidates: Sequence[Candidate], chosen: Candidate,
                tier_runs: Mapping[str, int],
                min_blocks: int = MIN_HINT_BLOCKS) -> Optional[PeerSource]:
    """The source of the longest run of the chain's leading blocks beyond what ``chosen``
    reaches by itself, at least ``min_blocks`` beyond it; None if there is none.

    ``tier_runs``: node tier id → how many of the chain's leading blocks (from block 0) it
    holds. ``chosen``'s own tier is left out (it restores from it at admission anyway). A
    tier wins a tie with a replica: reading it needs no step of another engine. Ties among
    tiers: the smallest id (deterministic)."""
    holder = best_holder(candidates, chosen, min_blocks)
    reach = chosen.matched_blocks + chosen.host_blocks
    tiers = sorted((-n, t) for t, n in tier_runs.items()
                   if t != chosen.info.kv_tier and n - reach >= min_blocks)
    if tiers and (holder is None or -tiers[0][0] >= holder.matched_blocks):
        return PeerSource(-tiers[0][0], tier_id=tiers[0][1])
    if holder is None:
        return None
    return PeerSource(holder.matched_blocks, holder.info.replica_id, holder.info.address)


def set_hint(worker_req: worker_pb2.WorkerGenerateRequest, source: PeerSource,
             chosen: Candidate) -> None:
    """Fill ``worker_req.peer`` from ``source`` (the chosen replica's own match too)."""
    peer = worker_req.peer
    peer.replica_id, peer.address, peer.tier_id = source.replica_id, source.address, source.tier_id
    peer.num_blocks, peer.first_block = source.num_blocks, chosen.matched_blocks


async def tier_runs(index: PrefixIndex, chain: Sequence[bytes]) -> dict[str, int]:
    """Per node tier ``index`` knows (:meth:`PrefixIndex.tier_ids`), how many of ``chain``'s
    leading blocks it holds (tiers with none left out). Raises ``IndexUnavailable``."""
    tiers = index.tier_ids()
    if not tiers or not chain:
        return {}
    return await index.host_match(chain, {t: (t, 0) for t in tiers})
