"""The peer hint a routed request carries (issue 26 §2): when the chosen replica holds less of
the prompt's prefix than another live replica (the policy traded the match for load), the
worker request names that replica, its address and both matches, and the chosen replica may
pull the difference from it instead of recomputing (``worker/kv_tier/peer_pull.py``)."""

from __future__ import annotations

from typing import Optional, Sequence

from kvfleet.router.policy import Candidate
from kvfleet.v1 import worker_pb2

MIN_HINT_BLOCKS = 1  # blocks the holder must hold beyond the chosen replica's own match


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


def set_hint(worker_req: worker_pb2.WorkerGenerateRequest, holder: Candidate,
             chosen: Candidate) -> None:
    """Fill ``worker_req.peer`` from ``holder`` (the chosen replica's own match too)."""
    peer = worker_req.peer
    peer.replica_id, peer.address = holder.info.replica_id, holder.info.address
    peer.num_blocks, peer.first_block = holder.matched_blocks, chosen.matched_blocks
