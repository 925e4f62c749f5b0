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

The last four are the safety net when the load target is set too high for the SLO: at or
above ``headroom`` the policy asks for one replica more (not in proportion: none of them is
linear in the count, and the measured p90s describe the requests of the last
:data:`LATENCY_WINDOW_S`, so they still show a queue the last step already answered: they
count only once the running count has been settled that long). It scales down only while
each stays below ``margin`` (KV spread over the survivors). The band between holds the count.
Serve's ``downscale_delay_s`` makes every scale-down a sustained one. The policy never goes
below ``min_replicas``. It does not scale down while replicas still start or stop, while a
rollout runs (replicas report different revisions) or while running replicas have not
reported every signal (the decision names them); it scales up in all three. A replica still
not running ``start_timeout_s`` after Serve was asked for it (it cannot be placed) is taken
as not coming: the fleet is judged as it runs, so scale-in is never blocked by it; reports
incomplete that long no longer hold a scale-down either (the others' means decide). The
times come from :class:`~kvfleet.worker.replica.autoscale_clock.FleetClock`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from kvfleet.worker.replica.autoscale_clock import Clocks

NO_CLOCKS = Clocks()  # nothing pending, settled for ever, nothing missing

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
           "within_band", "at_min", "at_max", "rollout", "starting", "no_metrics",
           "missing_metrics", "not_placed")
LAGGING = ("ttft_p90", "itl_p90")  # measured over the latency window, not now
LATENCY_WINDOW_S = 30.0  # the replicas' TTFT / ITL p90 window (load_report.LatencyWindow)


@dataclass(frozen=True)
class AutoscaleTargets:
    """What the operator asks the fleet to hold (``--autoscale MIN..MAX``, ``--slo-ttft-ms``,
    ``--slo-itl-ms``, ``--target-kv-utilisation``, ``--target-load``). Seconds; utilisation and
    load as 0..1.

    ``target_load``: the share of each replica's throughput to run at (the rest absorbs
    bursts shorter than a replica's start); ``load_band``: scale down only to a count that
    runs each survivor at most at ``target_load × (1 - load_band)``. ``headroom``: scale up
    once a latency or KV ratio reaches this fraction of its target; ``margin``: scale down
    only while each stays below this fraction. ``start_timeout_s``: a replica asked for and
    not running after this long is taken as not coming (it cannot be placed).

    Raises:
        ValueError: naming the flag: MIN < 1 or MIN > MAX, an SLO <= 0, a utilisation or
            load target outside (0, 1], no latency or KV target at all, a band outside
            [0, 1), ``0 < margin < headroom <= 1`` broken, or a start timeout <= 0.
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
    start_timeout_s: float = 120.0

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
        if not self.start_timeout_s > 0:
            raise ValueError(f"autoscale start_timeout_s must be > 0, got {self.start_timeout_s:g}")
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
    """Each target's ratio (signal / target, the mean over the replicas in ``reports`` that
    reported that signal); {} without reports."""
    rows = list(reports.values())

    def mean(fn, *names: str) -> Optional[float]:
        have = [r for r in rows if all(n in r for n in names)]
        return sum(fn(r) for r in have) / len(have) if have else None

    wanted = [("load", THROUGHPUT_LOAD, targets.target_load)]
    if targets.slo_ttft_s is not None:
        wanted += [("queue_delay", QUEUE_DELAY_S, targets.slo_ttft_s),
                   ("ttft_p90", TTFT_P90_S, targets.slo_ttft_s)]
    if targets.slo_itl_s is not None:
        wanted.append(("itl_p90", ITL_P90_S, targets.slo_itl_s))
    out = {}
    for name, signal, target in wanted:
        value = mean(lambda r, s=signal: r[s], signal)
        if value is not None:
            out[name] = value / target
    kv = targets.target_kv_utilisation
    if kv is not None and (used := mean(_kv_used, KV_BLOCKS_USED, KV_BLOCKS_TOTAL)) is not None:
        out["kv_utilisation"] = used / kv
    return out


def _kv_used(r: Mapping[str, float]) -> float:
    total = r.get(KV_BLOCKS_TOTAL, 0.0)
    return r.get(KV_BLOCKS_USED, 0.0) / total if total else 0.0


def _wanted(targets: AutoscaleTargets, current: int, r: Mapping[str, float],
            settled: bool) -> tuple[int, str]:
    """The count the pressure asks for now, and the signal that asks the most: the load
    tracked to its target; one more for a latency or KV ratio past the headroom (a lagging
    p90 only once ``settled``)."""
    want, why = math.ceil(current * r.get("load", 0.0) - 1e-9), "load"
    for name, ratio in r.items():
        if name == "load" or ratio < targets.headroom or (name in LAGGING and not settled):
            continue
        if current + 1 > want:
            want, why = current + 1, name
    return want, why


def _may_shed(targets: AutoscaleTargets, current: int, r: Mapping[str, float]) -> int:
    """How many replicas fewer hold every target with the margins: the load at most
    ``target × (1 - load_band)`` per survivor, latencies below ``margin`` as they are (a
    replica fewer does not show in them until it has gone), KV below it as spread."""
    latency = max((v for k, v in r.items() if k not in ("load", "kv_utilisation")), default=0.0)
    if latency >= targets.margin:
        return 0
    keep = max(targets.min_replicas,
               math.ceil(current * r.get("load", 0.0) / (1 - targets.load_band)))
    kv = r.get("kv_utilisation", 0.0)
    while keep < current and kv * current / keep >= targets.margin:
        keep += 1
    return max(0, current - keep)


def decide(targets: AutoscaleTargets, current: int, target: int, reports: Reports,
           clocks: Clocks = NO_CLOCKS) -> Decision:
    """The replica count to hold, from the running replicas' latest ``reports``.

    Args:
        current: replicas running now (Serve's ``current_num_replicas``).
        target: the count Serve is moving to (``target_num_replicas``).
        reports: running replica id → its signals (:data:`SIGNALS`); replicas that have not
            reported yet are absent, and a replica may miss some signals.
        clocks: how long replicas have been pending, the count settled and reports incomplete
            (:class:`~kvfleet.worker.replica.autoscale_clock.FleetClock`). Replicas pending
            past ``start_timeout_s`` are taken as not coming; the lagging p90s count once the
            count has been settled :data:`LATENCY_WINDOW_S`; reports incomplete past
            ``start_timeout_s`` no longer hold a scale-down (the others' means decide).

    Returns a :class:`Decision` within ``min_replicas..max_replicas``.
    """
    lo, hi = targets.min_replicas, targets.max_replicas
    held = min(max(target, lo), hi)
    if not reports or current < 1:
        return Decision(held, "no_metrics", 0.0, "no replica has reported yet: holding")
    lost = target > current and clocks.pending_s >= targets.start_timeout_s
    if lost:  # asked for and never placed: judge the fleet that runs
        target = held = max(current, lo)
    r = ratios(targets, reports)
    pressure = max(r.values(), default=0.0)
    detail = ", ".join(f"{k} {v:.2f}" for k, v in r.items())
    want, why = _wanted(targets, current, r, clocks.settled_s >= LATENCY_WINDOW_S)
    if want > current:
        want = min(hi, want)
        if want <= held:  # already moving there (or at MAX): do not stack another step
            return Decision(held, "at_max" if held == hi else "starting", pressure, detail)
        return Decision(want, why, pressure, detail)
    hold = _hold_reason(current, target, reports)
    if hold is not None and (hold[0] != "missing_metrics"
                             or clocks.missing_s < targets.start_timeout_s):
        return Decision(held, hold[0], pressure, f"{hold[1]}: holding; {detail}")
    if hold is not None:  # incomplete for long: say so, judge on what was reported
        detail = f"{hold[1]} for {clocks.missing_s:.0f} s; {detail}"
    shed = _may_shed(targets, current, r)
    if lost:
        return Decision(max(lo, current - shed), "not_placed", pressure,
                        f"replicas asked for {clocks.pending_s:.0f} s ago are not running (not "
                        f"placed?): judged on the {current} running; {detail}")
    if current <= lo:
        return Decision(lo, "at_min", pressure, detail)
    if shed:
        return Decision(current - shed, "sustained_margin", pressure, detail)
    return Decision(current, "within_band", pressure, detail)


def complete(current: int, reports: Reports) -> bool:
    """Every one of the ``current`` running replicas reported every signal."""
    return len(reports) >= current and all(s in row for row in reports.values() for s in SIGNALS)


def _hold_reason(current: int, target: int, reports: Reports) -> Optional[tuple[str, str]]:
    """Why no scale-down may be judged now ((reason, detail)), or None."""
    if current != target:  # replicas start or stop: judge the fleet once it has settled
        return "starting", f"{current} running, {target} asked for"
    if len({round(r[REVISION_ID]) for r in reports.values() if REVISION_ID in r}) > 1:
        return "rollout", "replicas of two revisions run"
    if not complete(current, reports):
        missing = sorted(rid for rid, row in reports.items()
                         if any(s not in row for s in SIGNALS))
        who = f"; incomplete: {', '.join(missing)}" if missing else ""
        return "missing_metrics", (f"{len(reports) - len(missing)} of {current} running "
                                   f"replicas reported every signal{who}")
    return None


def serve_reports(aggregated: Optional[Mapping[str, Mapping[object, float]]],
                  running: Sequence[object]) -> dict[str, dict[str, float]]:
    """Serve's ``AutoscalingContext.aggregated_metrics`` (signal → replica → value) turned
    into :data:`Reports` of the ``running`` replicas that reported any signal (a replica
    missing some is kept with what it has: :func:`decide` names it)."""
    out: dict[str, dict[str, float]] = {}
    metrics = aggregated or {}
    for rid in running:
        row = {name: float(metrics[name][rid]) for name in SIGNALS
               if name in metrics and rid in metrics[name]}
        if row:
            out[str(getattr(rid, "unique_id", rid))] = row
    return out
