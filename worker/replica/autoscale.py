"""kvfleet's autoscaling policy as a pure function: what the replicas report → how many
replicas, and why.

Ray Serve runs it (``kvfleet.deploy.autoscale_serve`` wraps it for ``AutoscalingConfig.policy``)
and applies its own ``upscale_delay_s`` / ``downscale_delay_s`` and min/max bounds to what it
returns; ``bench/fleet_sim.py`` calls the same :func:`decide` in virtual time. Nothing here
reads a clock, Ray or Redis.

The signals (:data:`SIGNALS`, one value per replica per metrics interval, from
``kvfleet.worker.replica.load_report``) are compared with the operator's targets as ratios
(1.0 = at the target):

- ``queue_delay``: predicted wait before a new request's prefill starts / TTFT SLO;
- ``ttft_p90``: measured TTFT p90 of recent requests / TTFT SLO;
- ``itl_p90``: measured inter-token latency p90 / ITL SLO;
- ``kv_utilisation``: KV blocks used / total, over the target utilisation;
- ``seq_slots``: running + waiting sequences / ``max_num_seqs`` (always on: load in
  proportion, where latency stays flat until the slots run out and then climbs at once).

Each ratio is the mean over the replicas that reported (the router spreads load; one hot
replica is the router's to fix, not a reason to buy one more). The largest is the fleet's
pressure. At or above ``headroom`` the policy scales up in proportion (``n·pressure/headroom``
replicas). It scales down by one only while every latency ratio stays below ``margin``, the
KV ratio spread over one replica fewer stays below ``margin`` too, and the survivors' sequence
slots would stay below ``headroom`` — the band between
``margin`` and ``headroom`` holds the count (hysteresis); Serve's ``downscale_delay_s`` makes
the margin a sustained one. It never goes below ``min_replicas``, and holds the count while a
rollout runs (replicas report different revisions) or replicas still start or stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

# What each replica reports to Serve (record_autoscaling_stats), by key.
KV_BLOCKS_USED = "kv_blocks_used"
KV_BLOCKS_TOTAL = "kv_blocks_total"
WAITING = "waiting"
RUNNING = "running"
PREFILL_TOKENS_QUEUED = "prefill_tokens_queued"
QUEUE_DELAY_S = "predicted_queue_delay_s"
TTFT_P90_S = "ttft_p90_s"
ITL_P90_S = "itl_p90_s"
PREFIX_HIT_RATE = "prefix_hit_rate"
MAX_NUM_SEQS = "max_num_seqs"
REVISION_ID = "revision_id"
SIGNALS = (KV_BLOCKS_USED, KV_BLOCKS_TOTAL, WAITING, RUNNING, PREFILL_TOKENS_QUEUED,
           QUEUE_DELAY_S, TTFT_P90_S, ITL_P90_S, PREFIX_HIT_RATE, MAX_NUM_SEQS, REVISION_ID)

# Decision reasons (the ``reason`` label of kvfleet_autoscale_target); docs/operating.md
# says what each means.
REASONS = ("queue_delay", "ttft_p90", "itl_p90", "kv_utilisation", "seq_slots", "sustained_margin",
           "within_band", "at_min", "at_max", "rollout", "starting", "no_metrics")


@dataclass(frozen=True)
class AutoscaleTargets:
    """What the operator asks the fleet to hold (``--autoscale MIN..MAX``, ``--slo-ttft-ms``,
    ``--slo-itl-ms``, ``--target-kv-utilisation``). Seconds; utilisation as 0..1.

    ``headroom``: scale up once a ratio reaches this fraction of its target; ``margin``:
    scale down only while every ratio stays below this fraction.

    Raises:
        ValueError: naming the flag: MIN < 1 or MIN > MAX, an SLO <= 0, a utilisation
            outside (0, 1], no target at all, or ``0 < margin < headroom <= 1`` broken.
    """

    min_replicas: int
    max_replicas: int
    slo_ttft_s: Optional[float] = None
    slo_itl_s: Optional[float] = None
    target_kv_utilisation: Optional[float] = None
    headroom: float = 0.8
    margin: float = 0.4

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"--autoscale: MIN must be >= 1, got {self.min_replicas}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"--autoscale: MIN ({self.min_replicas}) > MAX ({self.max_replicas})")
        for flag, value in (("--slo-ttft-ms", self.slo_ttft_s), ("--slo-itl-ms", self.slo_itl_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value * 1000:g}")
        kv = self.target_kv_utilisation
        if kv is not None and not 0 < kv <= 1:
            raise ValueError(f"--target-kv-utilisation must be in (0, 1], got {kv:g}")
        if self.slo_ttft_s is None and self.slo_itl_s is None and kv is None:
            raise ValueError("--autoscale needs a target: --slo-ttft-ms, --slo-itl-ms or "
                             "--target-kv-utilisation")
        if not 0 < self.margin < self.headroom <= 1:
            raise ValueError(f"autoscale margin ({self.margin:g}) and headroom "
                             f"({self.headroom:g}) must satisfy 0 < margin < headroom <= 1")

    def to_kwargs(self) -> dict:
        """JSON-serialisable fields (Serve's ``policy_kwargs``)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Decision:
    """``target`` replicas; ``reason`` one of :data:`REASONS`; ``pressure`` the largest
    ratio (1.0 = at target); ``detail`` a line for logs and ``kvfleet status``."""

    target: int
    reason: str
    pressure: float
    detail: str


Reports = Mapping[str, Mapping[str, float]]  # replica id → signal name → value


def ratios(targets: AutoscaleTargets, reports: Reports) -> dict[str, float]:
    """Each target's ratio (signal / target, mean over ``reports``); {} without reports."""
    if not reports:
        return {}
    rows = list(reports.values())

    def mean(fn) -> float:
        return sum(fn(r) for r in rows) / len(rows)

    out = {}
    if targets.slo_ttft_s is not None:
        out["queue_delay"] = mean(lambda r: r.get(QUEUE_DELAY_S, 0.0)) / targets.slo_ttft_s
        out["ttft_p90"] = mean(lambda r: r.get(TTFT_P90_S, 0.0)) / targets.slo_ttft_s
    if targets.slo_itl_s is not None:
        out["itl_p90"] = mean(lambda r: r.get(ITL_P90_S, 0.0)) / targets.slo_itl_s
    if targets.target_kv_utilisation is not None:
        out["kv_utilisation"] = mean(_kv_used) / targets.target_kv_utilisation
    # Sequence slots: load in proportion (latency only rises once slots run out).
    out["seq_slots"] = mean(_seats_used)
    return out


_LOAD = ("kv_utilisation", "seq_slots")  # signals linear in load (the rest: latencies)


def _kv_used(r: Mapping[str, float]) -> float:
    total = r.get(KV_BLOCKS_TOTAL, 0.0)
    return r.get(KV_BLOCKS_USED, 0.0) / total if total else 0.0


def _seats_used(r: Mapping[str, float]) -> float:
    seats = r.get(MAX_NUM_SEQS, 0.0)
    return (r.get(RUNNING, 0.0) + r.get(WAITING, 0.0)) / seats if seats else 0.0


def decide(targets: AutoscaleTargets, current: int, target: int, reports: Reports) -> Decision:
    """The replica count to hold, from the running replicas' latest ``reports``.

    Args:
        current: replicas running now (Serve's ``current_num_replicas``).
        target: the count Serve is moving to (``target_num_replicas``).
        reports: running replica id → its signals (:data:`SIGNALS`); replicas that have not
            reported yet are absent.

    Returns a :class:`Decision` within ``min_replicas..max_replicas``.
    """
    lo, hi = targets.min_replicas, targets.max_replicas
    held = min(max(target, lo), hi)
    if len({round(r.get(REVISION_ID, 0.0)) for r in reports.values()}) > 1:
        return Decision(held, "rollout", 0.0, "replicas of two revisions run: holding")
    if not reports or current < 1:
        return Decision(held, "no_metrics", 0.0, "no replica has reported yet: holding")
    r = ratios(targets, reports)
    signal = max(r, key=r.__getitem__)
    pressure = r[signal]
    detail = ", ".join(f"{k} {v:.2f}" for k, v in r.items())
    if pressure >= targets.headroom:
        want = min(hi, max(current + 1, math.ceil(current * pressure / targets.headroom)))
        if want <= held:  # already moving there (or at MAX): do not stack another step
            reason = "at_max" if held == hi else "starting"
            return Decision(held, reason, pressure, detail)
        return Decision(want, signal, pressure, detail)
    if current != target:  # replicas start or stop: judge the fleet once it has settled
        return Decision(held, "starting", pressure, detail)
    if current <= lo:
        return Decision(lo, "at_min", pressure, detail)
    spread = current / (current - 1)  # each survivor takes this much more load
    latency = max((v for k, v in r.items() if k not in _LOAD), default=0.0)
    if (latency < targets.margin and r.get("kv_utilisation", 0.0) * spread < targets.margin
            and r["seq_slots"] * spread < targets.headroom):
        return Decision(current - 1, "sustained_margin", pressure, detail)
    return Decision(current, "within_band", pressure, detail)


def serve_reports(aggregated: Optional[Mapping[str, Mapping[object, float]]],
                  running: Sequence[object]) -> dict[str, dict[str, float]]:
    """Serve's ``AutoscalingContext.aggregated_metrics`` (signal → replica → value) turned
    into :data:`Reports` of the ``running`` replicas that reported every signal."""
    out: dict[str, dict[str, float]] = {}
    metrics = aggregated or {}
    for rid in running:
        row = {name: float(metrics[name][rid]) for name in SIGNALS
               if name in metrics and rid in metrics[name]}
        if len(row) == len(SIGNALS):
            out[str(getattr(rid, "unique_id", rid))] = row
    return out
