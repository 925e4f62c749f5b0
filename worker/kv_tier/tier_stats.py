"""The host tier's counters as the engine's stats report them (what the tier metrics read):
rank 0's write-backs and restores, admission's lookups, the node tier's bytes (as last
refreshed), and the prompt tokens admitted with their hits by tier."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvfleet.worker.engine.scheduling.hit_counts import HitCounts
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.rank_tier import RankTier


def tier_stats(hits: HitCounts, lookup: Optional[TierLookup],
               rank_tier: Optional[RankTier]) -> dict[str, Any]:
    """``{"prefix_hits": {prompt_tokens, device, host}}``, plus ``"kv_tier"`` when the replica
    has a tier: ``write_backs``, ``dropped_write_backs``, ``restores``, ``failed_restores``,
    ``bytes_written``, ``bytes_restored`` (rank 0), ``lookups``, ``lookup_hits`` (blocks),
    and the node's ``bytes_used`` / ``capacity_bytes`` once read (bytes, integers)."""
    out: dict[str, Any] = {"prefix_hits": hits.as_dict()}
    if lookup is None:
        return out
    tier: dict[str, Any] = {"lookups": lookup.lookups, "lookup_hits": lookup.hits}
    if rank_tier is not None:
        tier.update(dataclasses.asdict(rank_tier.stats))
    node = lookup.node_stats
    if node is not None:
        tier.update(bytes_used=node.bytes_used, capacity_bytes=node.capacity_bytes)
    out["kv_tier"] = tier
    return out
