"""The host tier's counters as the engine's stats report them (what the tier metrics read):
rank 0's write-backs and restores, admission's lookups, the node tier's bytes (as last
refreshed), and the prompt tokens admitted with their hits by tier."""

from __future__ import annotations

from typing import Any

from kvfleet.worker.engine.scheduling.hit_counts import HitCounts
from kvfleet.worker.kv_tier.admission import NoTierAdmission, TierAdmission
from kvfleet.worker.kv_tier.rank_tier import NoRankTier, RankTier


def tier_stats(hits: HitCounts, admission: TierAdmission | NoTierAdmission,
               rank_tier: RankTier | NoRankTier) -> dict[str, Any]:
    """``{"prefix_hits": {prompt_tokens, device, host}}``, plus ``"kv_tier"`` when the replica
    has a tier: ``write_backs``, ``dropped_write_backs``, ``restores``, ``failed_restores``,
    ``bytes_written``, ``bytes_restored`` (rank 0), ``lookups``, ``lookup_hits`` (blocks),
    and the node's ``bytes_used`` / ``capacity_bytes`` once read (bytes, integers)."""
    out: dict[str, Any] = {"prefix_hits": hits.as_dict()}
    if admission.enabled:
        out["kv_tier"] = {**admission.counters(), **rank_tier.counters()}
    return out
