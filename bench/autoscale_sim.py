"""Autoscaling policies over a simulated day, in virtual time (issue 28).

The fleet is bench/fleet_sim.py's: real engines (scheduler, block pool, prefix cache) whose
forward is the cost model's step time on a simulated clock, routed by the real prefix-aware
policy over the in-memory index. On top runs a simulated Serve control loop: every metrics
interval each replica's report is made by the replicas' own function
(kvfleet.worker.replica.load_report.replica_report), averaged over Serve's look-back window,
handed to the policy, and the result goes through Serve's own delay logic
(ray.serve.autoscaling_policy._apply_delay_logic) and bounds. A new replica serves
``--start-delay`` seconds after the decision (docs/operating.md: 7 s measured) with a cold
cache; a removed one (Serve stops the newest) drains: no new requests, its streams finish.

Policies compared on the same request stream: ``static-peak`` (MAX replicas), ``static-mean``
(the mean load's replicas), ``serve-default`` (Serve's request-count policy,
``target_ongoing_requests`` fed kvfleet's running count) and ``kvfleet``
(kvfleet.worker.replica.autoscale.decide, the function Serve runs).

    .venv/bin/python -m bench autoscale_sim --day-s 600 --max 4
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from ray.serve.autoscaling_policy import _apply_delay_logic
from ray.serve.config import AutoscalingConfig

from bench.fleet_sim import Result, SimFleet, _sampling
from bench.workload import Request, Workload
from kvfleet.errors import ResourceExhausted
from bench.workload import requests as make_requests
from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import make_policy
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import MEASURED, CostModel, CostModelExecutor
from kvfleet.worker.replica.autoscale import AutoscaleTargets, decide
from kvfleet.worker.replica.hit_window import HitWindow
from kvfleet.worker.replica.load_report import LatencyWindow, replica_report
from kvfleet.worker.replica.replica import build_engine

RESULTS = Path(__file__).parent / "results"


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
        """Arrival offsets (s): a non-homogeneous Poisson process by thinning."""
        rng = random.Random(self.seed)
        top = self.peak_rps * self.burst_factor
        out, t = [], 0.0
        while True:
            t += rng.expovariate(top)
            if t >= self.day_s:
                return out
            if rng.random() * top < self.rate(t):
                out.append(t)


@dataclass
class Replica:
    rid: str
    started: float  # decision time (it costs from here)
    ready: float    # serving from here
    latency: LatencyWindow = field(default_factory=LatencyWindow)
    hits: HitWindow = field(default_factory=lambda: HitWindow(30.0))
    draining: bool = False
    stopped: Optional[float] = None
    reports: list = field(default_factory=list)  # (time, report)


# A policy: (current, target, reports, look-back-averaged) -> desired replicas.
Policy = Callable[[int, int, dict], int]


class ElasticFleet(SimFleet):
    """SimFleet whose replicas come and go: started ``start_delay_s`` after a decision,
    drained (no new requests; removed once idle) when the count drops."""

    def __init__(self, base_cfg, cost: CostModel, sched: SchedulerConfig, start: int,
                 start_delay_s: float) -> None:
        super().__init__(1, base_cfg.model_dir, base_cfg.num_blocks, cost,
                         make_policy("prefix_aware"), sched, base_cfg.block_size)
        self.base, self.cost, self.sched, self.start_delay_s = base_cfg, cost, sched, start_delay_s
        self.engines.clear()
        self.pubs.clear()
        self.replicas: dict[str, Replica] = {}
        self._next = 0
        for _ in range(start):
            self._launch(0.0, ready=0.0)

    def _launch(self, now: float, ready: Optional[float] = None) -> None:
        rid = f"r{self._next:03d}"
        self._next += 1
        r = Replica(rid, now, now + self.start_delay_s if ready is None else ready)
        self.replicas[rid] = r
        self._push(r.ready, "ready", rid)

    def _ready(self, rid: str) -> None:
        eng = build_engine(replace(self.base, replica_id=rid))
        ex = eng.executor
        eng.executor = CostModelExecutor(ex.config, self.cost, int(ex._row.argmax()),
                                         self.base.num_blocks, self.base.block_size,
                                         sleep=lambda s: None)
        self.engines[rid] = eng
        self.pubs[rid] = self.index.publisher(ReplicaInfo(rid, rid, "sim", 0, self.block_size))
        from bench.fleet_sim import run_sync

        run_sync(self.pubs[rid].register())
        self.busy[rid], self.inflight[rid] = False, 0
        n = self.base.num_blocks
        self.report[rid] = ReplicaLoad(0, 0, n, n, self.clock)

    def allocated(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.stopped is None]

    def serving(self) -> list[Replica]:
        return [r for r in self.allocated() if r.rid in self.engines and not r.draining]

    def set_target(self, target: int) -> None:
        live = [r for r in self.allocated() if not r.draining]
        for _ in range(target - len(live)):
            self._launch(self.clock)
        for r in sorted(live, key=lambda r: r.started)[target:]:  # Serve stops the newest
            r.draining = True
            if r.rid not in self.engines:  # never became ready: gone at once
                r.stopped = self.clock

    def _arrive(self, r: Request, results: dict, output_tokens: int) -> None:
        from bench.fleet_sim import Candidate, block_hash_chain, run_sync

        chain = block_hash_chain(self.root, r.token_ids, self.block_size)
        matched = run_sync(self.index.match(chain))
        cands = [Candidate(self.pubs[x.rid].replica, self.report[x.rid], matched.get(x.rid, 0),
                           self.inflight[x.rid]) for x in self.serving()]
        rid = self.policy.choose(cands, chain).info.replica_id
        params = SamplingParams.from_proto(_sampling(output_tokens))
        results[str(r.index)] = Result(r, rid, len(r.token_ids))
        try:
            self.engines[rid].add_request(EngineRequest(str(r.index), r.token_ids, params))
        except ResourceExhausted:  # refused as a full replica refuses: never within the SLO
            return
        self.inflight[rid] += 1
        if not self.busy[rid]:
            self._start_step(rid)

    def _step_done(self, rid: str, outputs, results: dict) -> None:
        super()._step_done(rid, outputs, results)
        rep = self.replicas[rid]
        for o in outputs:
            if o.finished and o.index == 0:
                res = results[o.request_id]
                n = o.usage.completion_tokens
                itl = (res.e2e_s - res.ttft_s) / (n - 1) if n > 1 and res.ttft_s else None
                rep.latency.add(res.ttft_s or 0.0, itl, self.clock)
                rep.hits.record(o, now=self.clock)
        if rep.draining and self.inflight[rid] == 0 and not self.busy[rid]:
            rep.stopped = self.clock

    def sample(self, look_back_s: float) -> dict[str, dict[str, float]]:
        """Each serving replica's report now, and its mean over ``look_back_s`` (Serve's)."""
        out = {}
        for r in self.serving():
            rep = replica_report(self.engines[r.rid].stats(), self.sched, r.latency,
                                 r.hits.rate(self.clock), now=self.clock)
            r.reports = [(t, x) for t, x in r.reports if t > self.clock - look_back_s]
            r.reports.append((self.clock, rep))
            out[r.rid] = {k: sum(x[k] for _, x in r.reports) / len(r.reports) for k in rep}
        return out

    def run_day(self, reqs: list[Request], output_tokens: int, policy: Optional[Policy],
                serve: AutoscalingConfig, interval_s: float, day_s: float) -> list[tuple]:
        """Run the day; returns the timeline (time, target, serving, allocated) per tick."""
        results: dict[str, Result] = {}
        self.results = results
        self._closed = None  # open loop (SimFleet's closed-loop refill off)
        for r in reqs:
            self._push(r.offset_s, "arrive", r)
        t = 0.0
        while t < day_s:
            self._push(t, "tick", None)
            t += interval_s
        state: dict = {}
        target = len(self.replicas)
        timeline = []
        while self._events:
            self.clock, _, kind, data = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(data, results, output_tokens)
            elif kind == "ready":
                if not self.replicas[data].draining:
                    self._ready(data)
                else:
                    self.replicas[data].stopped = self.clock
            elif kind == "tick":
                reports = self.sample(serve.look_back_period_s)
                if policy is not None:
                    current = len(self.serving())
                    desired = policy(current, target, reports)
                    desired, state = _apply_delay_logic(desired, target, serve, state,
                                                        _now=self.clock)
                    desired = min(max(desired, serve.min_replicas), serve.max_replicas)
                    if desired != target:
                        target = desired
                        self.set_target(target)
                timeline.append((self.clock, target, len(self.serving()), len(self.allocated())))
            else:
                self._step_done(*data, results)
        self.end = self.clock
        return timeline

    def replica_hours(self) -> float:
        """Replica-seconds allocated (decision to stop) over the day, in replica-days ×
        24 (replica-hours of the uncompressed day)."""
        return sum((r.stopped if r.stopped is not None else self.end) - r.started
                   for r in self.replicas.values())


def kvfleet_policy(targets: AutoscaleTargets) -> Policy:
    return lambda current, target, reports: decide(targets, current, target, reports).target


def serve_default(target_ongoing: float) -> Policy:
    """Serve's replica_queue_length policy: running requests / target per replica."""
    def policy(current: int, target: int, reports: dict) -> int:
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
    for r, t in zip(rs, ttft):
        windows.setdefault(int(r.request.offset_s // window_s), []).append(t)
    good = sum(_p99(v) <= slo_s for v in windows.values())
    targets = [row[1] for row in timeline]
    return {
        "requests": len(rs),
        "slo_requests": sum(t <= slo_s for t in ttft) / len(rs),
        "slo_windows": good / len(windows),
        "replica_hours": fleet.replica_hours() / day_s * 24,
        "scale_events": sum(a != b for a, b in zip(targets, targets[1:])),
        "refused": sum(r.ttft_s is None for r in rs),
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
    from bench.plots import _pyplot, _save

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


def main(argv: list[str] | None = None) -> int:
    from kvfleet.deploy.models import prepare_model
    from kvfleet.worker.replica.replica import ReplicaConfig

    p = argparse.ArgumentParser(prog="bench.autoscale_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--day-s", type=float, default=600.0, help="the compressed day (seconds)")
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--peak", type=float, default=0.7,
                   help="diurnal peak as a fraction of MAX replicas' saturated throughput")
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--cost-scale", type=float, default=0.1,
                   help="cost model × this (0.1: a replica 10x faster than the 2-core CPU)")
    p.add_argument("--start-delay", type=float, default=7.0)
    p.add_argument("--interval", type=float, default=2.0, help="metrics interval (s)")
    p.add_argument("--upscale-delay", type=float, default=5.0)
    p.add_argument("--downscale-delay", type=float, default=60.0)
    p.add_argument("--target-ongoing", type=float, default=8.0,
                   help="Serve default policy: running requests per replica")
    p.add_argument("--policies", default="static-peak,static-mean,serve-default,kvfleet")
    p.add_argument("--out", type=Path, default=RESULTS / "autoscale_sim.json")
    a = p.parse_args(argv)
    cost = MEASURED.scaled(a.cost_scale)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    w = Workload(groups=12, prefix_tokens=256, suffix_tokens=32, output_tokens=16, zipf_s=1.0)
    base = ReplicaConfig("", "sim", str(prepare_model(progress=False)), num_blocks=512,
                         executor="cost-model", cost_model=cost, scheduler=sched)
    cap = capacity_rps(base, cost, sched, w, 400)
    day = Day(a.day_s, cap * a.max * a.peak)
    offsets = day.arrivals()
    stream = make_requests(w, float("inf"), len(offsets), seed=1)
    reqs = [replace(r, offset_s=t) for r, t in zip(stream, offsets)]
    mean_rps = len(reqs) / a.day_s
    static_mean = max(a.min, math.ceil(mean_rps / cap))
    targets = AutoscaleTargets(a.min, a.max, slo_ttft_s=a.slo_ttft_ms / 1000)
    serve = AutoscalingConfig(min_replicas=a.min, max_replicas=a.max, look_back_period_s=12.0,
                              upscale_delay_s=a.upscale_delay, downscale_delay_s=a.downscale_delay)
    runs = {"static-peak": (a.max, None), "static-mean": (static_mean, None),
            "serve-default": (a.min, serve_default(a.target_ongoing)),
            "kvfleet": (a.min, kvfleet_policy(targets))}
    out: dict = {"capacity_rps": cap, "peak_rps": day.peak_rps, "mean_rps": mean_rps,
                 "requests": len(reqs), "slo_ttft_ms": a.slo_ttft_ms, "args": vars(a) | {"out": str(a.out)},
                 "policies": {}}
    timelines, p99 = {}, {}
    window = a.day_s / 144  # 10 minutes of the uncompressed day
    for name in a.policies.split(","):
        start, policy = runs[name]
        fleet = ElasticFleet(base, cost, sched, start, a.start_delay)
        timelines[name] = fleet.run_day(reqs, w.output_tokens, policy, serve, a.interval, a.day_s)
        p99[name] = p99_series(fleet, window)
        out["policies"][name] = summarize(fleet, timelines[name], a.slo_ttft_ms / 1000,
                                          a.day_s, window)
        print(name, json.dumps(out["policies"][name]), flush=True)
    peak = out["policies"].get("static-peak", {}).get("replica_hours")
    if peak:
        for v in out["policies"].values():
            v["replica_hours_vs_peak"] = v["replica_hours"] / peak
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print("plot:", plot(timelines, p99, a.slo_ttft_ms / 1000, a.day_s,
                        a.out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
