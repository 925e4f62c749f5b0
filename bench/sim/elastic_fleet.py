"""A fleet whose replicas come and go, in virtual time, under a simulated Serve control loop
(bench/sim/autoscale_sim.py runs the day on it).

It is bench/sim/fleet_sim.py's fleet (real engines, cost-model forward on a simulated clock,
prefix-aware routing over the in-memory index). Every metrics interval each replica's report
is made by the replicas' own function (kvfleet.worker.replica.load_report.replica_report),
averaged over Serve's look-back window, handed to a policy, and the result goes through
Serve's own delay logic (ray.serve.autoscaling_policy._apply_delay_logic) and bounds. A new
replica serves ``start_delay_s`` after the decision with a cold cache; a removed one (Serve
stops the newest) drains: no new requests, its streams finish.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ray.serve.autoscaling_policy import _apply_delay_logic
from ray.serve.config import AutoscalingConfig

from bench.common.workload import Request
from bench.sim.fleet_sim import Candidate, Result, SimFleet, _sampling, block_hash_chain, run_sync
from kvfleet.errors import ResourceExhausted
from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import make_policy
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel, CostModelExecutor
from kvfleet.worker.replica.hit_window import HitWindow
from kvfleet.worker.replica.load_report import LatencyWindow, replica_report
from kvfleet.worker.replica.replica import build_engine


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


# A policy: (current, target, look-back-averaged reports, now) -> desired replicas.
Policy = Callable[[int, int, dict, float], int]


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
            if r.rid not in self.engines or (self.inflight[r.rid] == 0 and not self.busy[r.rid]):
                r.stopped = self.clock  # never became ready, or idle: gone at once

    def _arrive(self, r: Request, results: dict, output_tokens: int) -> None:

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
                    desired = policy(current, target, reports, self.clock)
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
