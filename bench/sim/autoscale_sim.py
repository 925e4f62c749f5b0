"""Autoscaling policies over a simulated day, in virtual time.

The fleet and the simulated Serve control loop are bench/sim/elastic_fleet.py's. Policies
compared on the same request stream: ``static-peak`` (MAX replicas), ``static-mean`` (the
mean load's replicas), ``serve-default`` (Serve's request-count policy,
``target_ongoing_requests`` fed kvfleet's running count) and ``kvfleet``
(kvfleet.worker.replica.autoscale.decide, the function Serve runs).

The day (:class:`Day`), the issue's "diurnal curve from 0.2× to 1.5× of one replica's
capacity × MAX" read so that a fleet of MAX can serve all of it: in units of
``c = MAX × capacity / 1.5`` the curve runs from 0.2 c (night) to 1.0 c (afternoon) and six
10-s bursts ×1.5 take it to the 1.5 c top, exactly MAX replicas' saturated throughput when a
burst meets the afternoon peak (anything above it no fleet of MAX serves). ``capacity`` is
one replica's saturated throughput on the day's workload, measured in the same run.

    .venv/bin/python -m bench autoscale_sim --day-s 360 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ray.serve.config import AutoscalingConfig

from bench.common.result_file import RESULTS
from bench.common.workload import Workload
from bench.common.workload import requests as make_requests
from bench.sim.elastic_fleet import ElasticFleet, Policy, Replica
from bench.sim.fleet_sim import SimFleet
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import MEASURED, CostModel
from kvfleet.worker.replica.autoscale import AutoscaleTargets, complete, decide
from kvfleet.worker.replica.autoscale_clock import FleetClock


@dataclass(frozen=True)
class Day:
    """A day compressed to ``day_s`` seconds: load(t) = ``peak_rps`` × diurnal(t) × burst(t).
    The diurnal curve runs from ``trough`` (night) to 1.0 (afternoon); ``bursts`` times a day
    the rate jumps ×``burst_factor`` for ``burst_s`` seconds."""

    day_s: float
    peak_rps: float
    trough: float = 0.2
    bursts: int = 6
    burst_factor: float = 1.5
    burst_s: float = 10.0
    seed: int = 0

    def diurnal(self, t: float) -> float:
        phase = 2 * math.pi * (t / self.day_s - 0.625)  # lowest at 03:00, highest at 15:00
        return self.trough + (1 - self.trough) * (1 + math.cos(phase)) / 2

    def burst_starts(self) -> list[float]:
        rng = random.Random(self.seed + 1)
        return sorted(rng.uniform(0.1, 0.9) * self.day_s for _ in range(self.bursts))

    def rate(self, t: float) -> float:
        burst = any(s <= t < s + self.burst_s for s in self.burst_starts())
        return self.peak_rps * self.diurnal(t) * (self.burst_factor if burst else 1.0)

    def arrivals(self) -> list[float]:
        """Arrival offsets (s) of the day."""
        return poisson_arrivals(self.rate, self.peak_rps * self.burst_factor, self.day_s,
                                self.seed)


def poisson_arrivals(rate: Callable[[float], float], top: float, duration_s: float,
                     seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate(t)`` ≤ ``top`` requests/s over
    ``duration_s`` seconds (by thinning)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration_s:
            return out
        if rng.random() * top < rate(t):
            out.append(t)


def kvfleet_policy(targets: AutoscaleTargets, look_back_s: float) -> Policy:
    """kvfleet's policy as Serve runs it (KvfleetPolicy: decide, with a FleetClock)."""
    clock = FleetClock(look_back_s)

    def policy(current: int, target: int, reports: dict, now: float) -> int:
        clocks = clock.observe(current, target, complete(current, reports), now)
        return decide(targets, current, target, reports, clocks).target
    return policy


def serve_default(target_ongoing: float) -> Policy:
    """Serve's replica_queue_length policy: running requests / target per replica."""
    def policy(current: int, target: int, reports: dict, now: float) -> int:
        if not current:
            return target
        total = sum(r["running"] for r in reports.values())
        return math.ceil(total / target_ongoing)
    return policy


def summarize(fleet: ElasticFleet, timeline: list[tuple], slo_s: float, day_s: float,
              window_s: float) -> dict:
    """SLO attainment (requests with TTFT <= SLO; windows of ``window_s`` whose TTFT p99 <=
    SLO), replica-hours (of the uncompressed day), scale events, prefix-hit rate."""
    rs = list(fleet.results.values())
    ttft = [r.ttft_s if r.ttft_s is not None else float("inf") for r in rs]
    windows: dict[int, list[float]] = {}
    for r, t in zip(rs, ttft, strict=True):
        windows.setdefault(int(r.request.offset_s // window_s), []).append(t)
    good = sum(_p99(v) <= slo_s for v in windows.values())
    targets = [row[1] for row in timeline]
    return {
        "requests": len(rs),
        "slo_requests": sum(t <= slo_s for t in ttft) / len(rs),
        "slo_windows": good / len(windows),
        "replica_hours": fleet.replica_hours() / day_s * 24,
        "scale_events": sum(a != b for a, b in zip(targets, targets[1:], strict=False)),
        "peak_target": max(targets, default=0),
        "target_changes": [(round(row[0], 1), row[1]) for prev, row
                           in zip(timeline, timeline[1:], strict=False) if row[1] != prev[1]],
        "refused": sum(r.ttft_s is None for r in rs),
        # Where the SLO was missed: (hour of the day, requests over it) per 10-minute window.
        "missed_at": [(round(k * window_s / day_s * 24, 2), n) for k, v in sorted(windows.items())
                      if (n := sum(t > slo_s for t in v))],
        "hit_rate": sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs),
        "ttft_p99_s": _p99(ttft),
    }


def _p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def p99_series(fleet: ElasticFleet, window_s: float) -> list[tuple[float, float]]:
    windows: dict[int, list[float]] = {}
    for r in fleet.results.values():
        windows.setdefault(int(r.request.offset_s // window_s), []).append(
            r.ttft_s if r.ttft_s is not None else float("inf"))
    return [((k + 0.5) * window_s, _p99(v)) for k, v in sorted(windows.items())]


def capacity_rps(base_cfg, cost: CostModel, sched: SchedulerConfig, w: Workload, n: int) -> float:
    """One replica's saturated throughput (requests/s): a closed loop of max_num_seqs
    clients over ``n`` requests of the day's workload."""
    fleet = ElasticFleet(base_cfg, cost, sched, 0, 0.0)
    fleet.replicas["r000"] = Replica("r000", 0.0, 0.0)
    fleet._ready("r000")
    res = SimFleet.run(fleet, make_requests(w, float("inf"), n, seed=99), w.output_tokens,
                       concurrency=sched.max_num_seqs)
    return len(res) / fleet.clock


def plot(timelines: dict, p99: dict, slo_s: float, day_s: float, path: Path) -> Path:
    from bench.common.plots import _pyplot, _save

    fig, (top, bottom) = _pyplot().subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True)
    hours = 24 / day_s
    for name, tl in timelines.items():
        top.step([t * hours for t, *_ in tl], [row[3] for row in tl], where="post", label=name)
        bottom.plot([t * hours for t, _ in p99[name]], [v * 1e3 for _, v in p99[name]],
                    label=name, lw=1)
    bottom.axhline(slo_s * 1e3, color="k", ls="--", lw=0.8, label="SLO")
    top.set_ylabel("replicas (allocated)")
    bottom.set_ylabel("TTFT p99 (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("hour of the simulated day")
    top.legend(fontsize=8, loc="upper left")
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def run_policies(a: argparse.Namespace, seed: int, plot_to: Path | None) -> dict:
    """One day (``seed``: arrivals, bursts and prompts) under every policy of ``a.policies``."""
    from kvfleet.deploy.models import prepare_model
    from kvfleet.worker.replica.replica import ReplicaConfig

    cost = MEASURED.scaled(a.cost_scale)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    w = Workload(groups=12, prefix_tokens=256, suffix_tokens=32, output_tokens=16, zipf_s=1.0)
    base = ReplicaConfig("", "sim", str(prepare_model(progress=False)), num_blocks=512,
                         executor="cost-model", cost_model=cost, scheduler=sched)
    cap = capacity_rps(base, cost, sched, w, 400)
    if a.steady:  # a constant load of `steady` replicas' saturated throughput, no burst
        day = Day(a.day_s, cap * a.steady, trough=1.0, bursts=0, seed=seed)
    else:
        day = Day(a.day_s, cap * a.max / 1.5, seed=seed)  # the 1.5 c top = MAX × capacity
    offsets = day.arrivals()
    stream = make_requests(w, float("inf"), len(offsets), seed=seed + 1)
    reqs = [replace(r, offset_s=t) for r, t in zip(stream, offsets, strict=True)]
    mean_rps = len(reqs) / a.day_s
    targets = AutoscaleTargets(a.min, a.max, slo_ttft_s=a.slo_ttft_ms / 1000,
                               target_load=a.target_load, load_band=a.load_band)
    serve = AutoscalingConfig(min_replicas=a.min, max_replicas=a.max, look_back_period_s=12.0,
                              upscale_delay_s=a.upscale_delay, downscale_delay_s=a.downscale_delay)
    first = a.initial or initial_replicas(day, cap, a.min, a.max)
    runs = {"static-peak": (a.max, None),
            "static-mean": (max(a.min, math.ceil(mean_rps / cap)), None),
            "serve-default": (first, serve_default(a.target_ongoing)),
            "kvfleet": (first, kvfleet_policy(targets, serve.look_back_period_s))}
    out: dict = {"seed": seed, "capacity_rps": cap, "peak_rps": day.peak_rps,
                 "mean_rps": mean_rps, "requests": len(reqs), "policies": {},
                 "steady_replicas": (math.ceil(a.steady / a.target_load - 1e-9)
                                     if a.steady else None),
                 "ideal_vs_peak": {f"load {u:g}": ideal_vs_peak(day, cap, a.min, a.max, u)
                                   for u in sorted({a.target_load, 0.8, 0.9, 1.0})}}
    print(seed, "clairvoyant fleet, replica-hours vs peak:", out["ideal_vs_peak"], flush=True)
    timelines, p99 = {}, {}
    window = a.day_s / 144  # 10 minutes of the uncompressed day
    for name in a.policies.split(","):
        start, policy = runs[name]
        fleet = ElasticFleet(base, cost, sched, start, a.start_delay)
        timelines[name] = fleet.run_day(reqs, w.output_tokens, policy, serve, a.interval, a.day_s)
        p99[name] = p99_series(fleet, window)
        out["policies"][name] = summarize(fleet, timelines[name], a.slo_ttft_ms / 1000,
                                          a.day_s, window)
        print(seed, name, json.dumps(out["policies"][name]), flush=True)
    peak = out["policies"].get("static-peak", {}).get("replica_hours")
    for v in out["policies"].values():
        v["replica_hours_vs_peak"] = v["replica_hours"] / peak if peak else None
    if plot_to is not None:
        print("plot:", plot(timelines, p99, a.slo_ttft_ms / 1000, a.day_s, plot_to))
    return out


def initial_replicas(day: Day, capacity: float, lo: int, hi: int) -> int:
    """Serve's ``initial_replicas`` for both autoscalers: what midnight's load needs at the
    default load target (the day before left the fleet there; starting at MIN would make a
    large MAX's day open with a queue no policy caused)."""
    need = day.rate(0.0) / (AutoscaleTargets.target_load * capacity)
    return min(hi, max(lo, math.ceil(need - 1e-9)))


def ideal_vs_peak(day: Day, capacity: float, lo: int, hi: int, load: float,
                  step_s: float = 0.1) -> float:
    """Replica-hours of a clairvoyant fleet, as a share of MAX's: at every instant
    ``ceil(rate / (load × capacity))`` replicas within MIN..MAX, no start delay, no
    hysteresis. The floor any policy holding ``load`` can reach on this day."""
    ts = [i * step_s for i in range(int(day.day_s / step_s))]
    need = [min(hi, max(lo, math.ceil(day.rate(t) / (load * capacity) - 1e-9))) for t in ts]
    return sum(need) / (len(need) * hi)


def table(days: list[dict]) -> dict[str, dict]:
    """Per policy, over the seeds: mean and range of SLO attainment and replica-hours."""
    rows: dict[str, dict] = {}
    for name in days[0]["policies"]:
        runs = [d["policies"][name] for d in days]
        row = {}
        for key in ("slo_requests", "slo_windows", "replica_hours", "replica_hours_vs_peak",
                    "scale_events", "hit_rate"):
            vals = [r[key] for r in runs if r.get(key) is not None]
            if vals:
                row[key] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
        rows[name] = row
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.sim.autoscale_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--day-s", type=float, default=600.0, help="the compressed day (seconds)")
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--initial", type=int, default=0,
                   help="autoscalers' initial replicas (0: what midnight's load needs)")
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--target-load", type=float, default=AutoscaleTargets.target_load,
                   help="kvfleet: share of each replica's throughput to run at")
    p.add_argument("--load-band", type=float, default=AutoscaleTargets.load_band,
                   help="kvfleet: scale down only to survivors at most at target × (1 - band)")
    p.add_argument("--cost-scale", type=float, default=0.1,
                   help="cost model × this (0.1: a replica 10x faster than the 2-core CPU)")
    p.add_argument("--start-delay", type=float, default=7.0)
    p.add_argument("--interval", type=float, default=2.0, help="metrics interval (s)")
    p.add_argument("--upscale-delay", type=float, default=5.0)
    p.add_argument("--downscale-delay", type=float, default=20.0,
                   help="(s) ~3 replica starts: a replica must stay unneeded this long")
    p.add_argument("--target-ongoing", type=float, default=8.0,
                   help="Serve default policy: running requests per replica")
    p.add_argument("--steady", type=float, default=0.0,
                   help="instead of the day: a constant load of this many replicas' "
                        "saturated throughput (the peak target is then compared with "
                        "the count that holds it at --target-load)")
    p.add_argument("--policies", default="static-peak,static-mean,serve-default,kvfleet")
    p.add_argument("--seeds", default="0", help="comma-separated days to run (arrivals, bursts)")
    p.add_argument("--out", type=Path, default=RESULTS / "autoscale_sim.json")
    a = p.parse_args(argv)
    seeds = [int(x) for x in a.seeds.split(",")]
    days = [run_policies(a, seed, a.out.with_suffix(".png") if i == 0 else None)
            for i, seed in enumerate(seeds)]
    out = {"args": vars(a) | {"out": str(a.out)}, "summary": table(days), "days": days}
    print(json.dumps(out["summary"], indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
