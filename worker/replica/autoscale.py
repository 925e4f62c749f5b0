"""kvfleet's autoscaling policy as a pure function: what the replicas report → how many
replicas, and why.

Ray Serve runs it (``kvfleet.deploy.autoscale_serve`` wraps it for ``AutoscalingConfig.policy``)
and applies its own ``upscale_delay_s`` / ``downscale_delay_s`` and min/max bounds to what it
returns; ``bench/sim/autoscale_sim.py`` calls the same :func:`decide` in virtual time. Nothing here
reads a clock, Ray or Redis.

The signals (:data:`SIGNALS`, one value per replica per metrics interval, from
``kvfleet.worker.replica.load_report``) are compared with the operator's targets as ratios
(1.0 = at the target), each the mean over the replicas that reported (the router spreads
load; one hot replica is the router's to fix, not a reason to buy one more):

- ``load``: the share of a replica's decode throughput in use plus its queue beyond the seats
  (``kvfleet.worker.step_cost.queue_delay.throughput_load``) / ``target_load``. Linear in the
  arrival rate, so ``n × load`` replicas hold each at the target: the policy **tracks** it,
  up as soon as that count exceeds ``n``, down (by as many as that allows) once it stays below
  ``n`` with a ``load_band`` to spare (asymmetric hysteresis: up at the target, down only
  well under it).
- ``queue_delay``: predicted wait before a new request's prefill starts / TTFT SLO;
- ``ttft_p90``: measured TTFT p90 of recent requests / TTFT SLO;
- ``itl_p90``: measured inter-token latency p90 / ITL SLO;
- ``kv_utilisation``: KV blocks used / total, over the target utilisation.

The last four are the safety net when the load target is set too high for the SLO: at or above
``headroom`` the policy scales up in proportion (``n·ratio/headroom`` replicas); it scales down
only while each stays below ``margin`` (KV spread over the survivors). The band between holds
the count. Serve's ``downscale_delay_s`` makes every scale-down a sustained one. The policy
never goes below ``min_replicas``, and holds the count while a rollout runs (replicas report
different revisions) or replicas still start or stop.
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
THROUGHPUT_LOAD = "throughput_load"
SIGNALS = (KV_BLOCKS_USED, KV_BLOCKS_TOTAL, WAITING, RUNNING, PREFILL_TOKENS_QUEUED,
           QUEUE_DELAY_S, TTFT_P90_S, ITL_P90_S, PREFIX_HIT_RATE, MAX_NUM_SEQS, REVISION_ID,
           THROUGHPUT_LOAD)

# Decision reasons (the ``reason`` label of kvfleet_autoscale_target); docs/operating.md
# says what each means.
REASONS = ("load", "queue_delay", "ttft_p90", "itl_p90", "kv_utilisation", "sustained_margin",
           "within_band", "at_min", "at_max", "rollout", "starting", "no_metrics")


@dataclass(frozen=True)
class AutoscaleTargets:
    """What the operator asks the fleet to hold (``--autoscale MIN..MAX``, ``--slo-ttft-ms``,
    ``--slo-itl-ms``, ``--target-kv-utilisation``, ``--target-load``). Seconds; utilisation and
    load as 0..1.

    ``target_load``: the share of each replica's throughput to run at (the rest absorbs
    bursts shorter than a replica's start); ``load_band``: scale down only to a count that
    runs each survivor at most at ``target_load × (1 - load_band)``. ``headroom``: scale up once
    a latency or KV ratio reaches this fraction of its target; ``margin``: scale down only
    while each stays below this fraction.

    Raises:
        ValueError: naming the flag: MIN < 1 or MIN > MAX, an SLO <= 0, a utilisation or
            load target outside (0, 1], no latency or KV target at all, a band outside
            [0, 1), or ``0 < margin < headroom <= 1`` broken.
    """

    min_replicas: int
    max_replicas: int
    slo_ttft_s: Optional[float] = None
    slo_itl_s: Optional[float] = None
    target_kv_utilisation: Optional[float] = None
    target_load: float = 0.7
    load_band: float = 0.15
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
        if not 0 < self.target_load <= 1:
            raise ValueError(f"--target-load must be in (0, 1], got {self.target_load:g}")
        if not 0 <= self.load_band < 1:
            raise ValueError(f"autoscale load_band must be in [0, 1), got {self.load_band:g}")
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

    out = {"load": mean(lambda r: r.get(THROUGHPUT_LOAD, 0.0)) / targets.target_load}
    if targets.slo_ttft_s is not None:
        out["queue_delay"] = mean(lambda r: r.get(QUEUE_DELAY_S, 0.0)) / targets.slo_ttft_s
        out["ttft_p90"] = mean(lambda r: r.get(TTFT_P90_S, 0.0)) / targets.slo_ttft_s
    if targets.slo_itl_s is not None:
        out["itl_p90"] = mean(lambda r: r.get(ITL_P90_S, 0.0)) / targets.slo_itl_s
    if targets.target_kv_utilisation is not None:
        out["kv_utilisation"] = mean(_kv_used) / targets.target_kv_utilisation
    return out


def _kv_used(r: Mapping[str, float]) -> float:
    total = r.get(KV_BLOCKS_TOTAL, 0.0)
    return r.get(KV_BLOCKS_USED, 0.0) / total if total else 0.0


def _wanted(targets: AutoscaleTargets, current: int, r: Mapping[str, float]) -> tuple[int, str]:
    """The count the pressure asks for now, and the signal that asks the most: the load
    tracked to its target, a latency or KV ratio past the headroom in proportion."""
    want, why = math.ceil(current * r["load"] - 1e-9), "load"
    for name, ratio in r.items():
        if name != "load" and ratio >= targets.headroom:
            need = max(current + 1, math.ceil(current * ratio / targets.headroom))
            if need > want:
                want, why = need, name
    return want, why


def _may_shed(targets: AutoscaleTargets, current: int, r: Mapping[str, float]) -> int:
    """How many replicas fewer hold every target with the margins: the load at most
    ``target × (1 - load_band)`` per survivor, latencies below ``margin`` as they are (a
    replica fewer does not show in them until it has gone), KV below it as spread."""
    latency = max((v for k, v in r.items() if k not in ("load", "kv_utilisation")), default=0.0)
    if latency >= targets.margin:
        return 0
    keep = max(targets.min_replicas, math.ceil(current * r["load"] / (1 - targets.load_band)))
    kv = r.get("kv_utilisation", 0.0)
    while keep < current and kv * current / keep >= targets.margin:
        keep += 1
    return max(0, current - keep)


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
    pressure = max(r.values())
    detail = ", ".join(f"{k} {v:.2f}" for k, v in r.items())
    want, why = _wanted(targets, current, r)
    if want > current:
        want = min(hi, want)
        if want <= held:  # already moving there (or at MAX): do not stack another step
            return Decision(held, "at_max" if held == hi else "starting", pressure, detail)
        return Decision(want, why, pressure, detail)
    if current != target:  # replicas start or stop: judge the fleet once it has settled
        return Decision(held, "starting", pressure, detail)
    if current <= lo:
        return Decision(lo, "at_min", pressure, detail)
    shed = _may_shed(targets, current, r)
    if shed:
        return Decision(current - shed, "sustained_margin", pressure, detail)
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
