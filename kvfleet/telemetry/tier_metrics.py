"""The worker's host-tier and hit-by-tier metrics: observable instruments over the engine's
stats snapshot (:meth:`kvfleet.worker.kv_tier.admission.TierAdmission.stats`), read at collection
time, so nothing is counted twice and nothing runs on the engine thread.

- ``kvfleet.worker.kv_tier.{write_backs, dropped_write_backs, restores, failed_restores}``
  (counters, blocks; ``failed_restores`` in restore calls) and ``…{bytes_written,
  bytes_restored}`` (counters, bytes): rank 0's side of the replica;
- ``kvfleet.worker.kv_tier.{bytes_used, capacity}`` (gauges, bytes): the node's tier as the
  heartbeat last read it (shared by the node's replicas: aggregate with max, not sum);
- ``kvfleet.worker.prefix_cache.tier_hit_tokens`` (counter, tokens) and ``…tier_hit_rate``
  (gauge, 0..1 of admitted prompt tokens), each labelled ``kvfleet.kv.tier`` = device | host;
- ``kvfleet.worker.kv_peer.{pulls, pulled_blocks, pull_time, skipped, refused, failed,
  timed_out, empty}`` (counters: pulls, blocks, seconds, hints): the replica's peer pulls
  (:class:`~kvfleet.worker.kv_tier.peer_pull.PullStats`), when it pulls at all.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from opentelemetry import metrics

from kvfleet.telemetry import names as n

_COUNTERS = (  # (metric, stats field, unit, description)
    (n.METRIC_TIER_WRITE_BACKS, "write_backs", "{block}", "Blocks written back to the host tier"),
    (n.METRIC_TIER_DROPPED_WRITE_BACKS, "dropped_write_backs", "{block}",
     "Evicted blocks not written back (queue full, or the put failed)"),
    (n.METRIC_TIER_RESTORES, "restores", "{block}", "Blocks restored from the host tier"),
    (n.METRIC_TIER_FAILED_RESTORES, "failed_restores", "{call}",
     "Restores that failed (the step recomputed instead)"),
    (n.METRIC_TIER_BYTES_WRITTEN, "bytes_written", "By", "Bytes written back to the host tier"),
    (n.METRIC_TIER_BYTES_RESTORED, "bytes_restored", "By", "Bytes restored from the host tier"),
)
_GAUGES = (
    (n.METRIC_TIER_BYTES_USED, "bytes_used", "By", "Bytes the node's host tier holds"),
    (n.METRIC_TIER_CAPACITY, "capacity_bytes", "By", "The node's host tier budget"),
)
TIERS = ("device", "host")
_PULL_COUNTERS = (  # (metric, PullStats field, unit, description)
    (n.METRIC_PEER_PULLS, "pulls", "{pull}", "Peer pulls that landed blocks in the node's host tier"),
    (n.METRIC_PEER_PULLED_BLOCKS, "pulled_blocks", "{block}", "Blocks those pulls brought"),
    (n.METRIC_PEER_PULL_TIME, "pull_s", "s", "Seconds those pulls took, in all"),
    (n.METRIC_PEER_PULLS_SKIPPED, "skipped", "{hint}",
     "Peer hints not pulled: recomputing was predicted cheaper, or nothing to pull"),
    (n.METRIC_PEER_PULLS_REFUSED, "refused", "{pull}",
     "Pulls refused: the answer's hashes differed from this replica's chain (recomputed)"),
    (n.METRIC_PEER_PULLS_FAILED, "failed", "{pull}",
     "Pulls that failed or timed out (recomputed)"),
    (n.METRIC_PEER_PULLS_TIMED_OUT, "timed_out", "{pull}",
     "Of the failed pulls, those past their timeout (a busy holder: recomputed)"),
    (n.METRIC_PEER_PULLS_EMPTY, "empty", "{pull}",
     "Pulls answered with no block: the peer no longer held them (recomputed)"),
)


def register_tier_metrics(meter: metrics.Meter, model: str,
                          stats_fn: Callable[[], dict]) -> None:
    """Create the instruments on ``meter``; ``stats_fn`` returns the engine's stats. A replica
    without a tier reports only the hits by tier (all device)."""
    attrs = {n.GEN_AI_REQUEST_MODEL: model}

    def field(name: str):
        def observe(_options):
            tier = stats_fn().get("kv_tier")
            if tier is not None and name in tier:
                yield metrics.Observation(tier[name], attrs)
        return observe

    for metric, name, unit, what in _COUNTERS:
        meter.create_observable_counter(metric, [field(name)], unit=unit, description=what)
    for metric, name, unit, what in _GAUGES:
        meter.create_observable_gauge(metric, [field(name)], unit=unit, description=what)

    def hit_tokens(_options):
        hits = stats_fn().get("prefix_hits", {})
        for tier in TIERS:
            yield metrics.Observation(hits.get(tier, 0), {**attrs, n.KVFLEET_KV_TIER: tier})

    def hit_rate(_options):
        hits = stats_fn().get("prefix_hits", {})
        total = hits.get("prompt_tokens", 0)
        for tier in TIERS:
            rate = hits.get(tier, 0) / total if total else 0.0
            yield metrics.Observation(rate, {**attrs, n.KVFLEET_KV_TIER: tier})

    meter.create_observable_counter(n.METRIC_PREFIX_HIT_TOKENS_BY_TIER, [hit_tokens],
                                    unit="{token}",
                                    description="Prompt tokens reused, by the tier they came from")
    meter.create_observable_gauge(n.METRIC_PREFIX_HIT_RATE_BY_TIER, [hit_rate], unit="1",
                                  description="Share of admitted prompt tokens reused, by tier")


def register_pull_metrics(meter: metrics.Meter, model: str,
                          pull_stats_fn: Callable[[], Optional[Any]]) -> None:
    """Create the peer-pull counters on ``meter``; ``pull_stats_fn`` returns the replica's
    ``PullStats`` (read at collection time), or None while it has no puller (nothing is
    reported then)."""
    attrs = {n.GEN_AI_REQUEST_MODEL: model}

    def field(name: str):
        def observe(_options):
            stats = pull_stats_fn()
            if stats is not None:
                yield metrics.Observation(getattr(stats, name), attrs)
        return observe

    for metric, name, unit, what in _PULL_COUNTERS:
        meter.create_observable_counter(metric, [field(name)], unit=unit, description=what)
