"""A virtual-time fleet: real engines (scheduler, block pool, prefix cache, sampling) driven by
the cost model's step times on a simulated clock, routed by the real policies over the
in-memory prefix index. No gRPC, no Redis, no sleeping: hundreds of replicas in seconds.

It is a design tool (compare policies and their knobs before a wall-clock run), not the
benchmark: ``bench/cluster/router_bench.py`` measures the real router, real Redis and real gRPC.

    .venv/bin/python -m bench.sim.fleet_sim --replicas 4 --zipf 1.1
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from bench.common.workload import Request, Workload, requests
from bench.engine.calibrate import DEFAULT_OUT as CALIBRATION
from bench.engine.calibrate import ensure_calibration
from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import Candidate, RoutingPolicy, make_policy
from kvfleet.router.prefix_index import InMemoryPrefixIndex
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel, CostModelExecutor
from kvfleet.worker.replica.replica import ReplicaConfig, build_engine


def run_sync(coro):
    """Run a coroutine that never suspends (the in-memory index's methods) to completion."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("coroutine suspended")


@dataclass
class Result:
    request: Request
    replica: str
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None


class SimFleet:
    def __init__(self, n: int, model_dir: str, num_blocks: int, cost: CostModel,
                 policy: RoutingPolicy, scheduler: SchedulerConfig = SchedulerConfig(),
                 block_size: int = 16, model_name: str = "sim",
                 scales: Sequence[float] = ()) -> None:
        """``scales``: per replica, a factor on ``cost``'s step times (2 = half speed); the
        replicas past its end run at ``cost``."""
        self.policy, self.block_size = policy, block_size
        self.clock = 0.0
        self.index = InMemoryPrefixIndex(replica_ttl_s=1e12, clock=lambda: self.clock)
        self.engines, self.pubs, self.busy, self.inflight, self.report = {}, {}, {}, {}, {}
        base = ReplicaConfig(replica_id="", model_name=model_name, model_dir=model_dir,
                             block_size=block_size, num_blocks=num_blocks, executor="cost-model",
                             cost_model=cost, scheduler=scheduler)
        for i in range(n):
            rid = f"r{i:03d}"
            own = cost.scaled(scales[i]) if i < len(scales) else cost
            eng = build_engine(replace(base, replica_id=rid, cost_model=own))
            # Virtual clock: a step's wall time says nothing of its modelled time, so the
            # replica's step-cost model (its forecast) stays at its own constants.
            eng.step_cost.alpha = 0.0
            r = eng.executor
            eng.executor = CostModelExecutor(r.config, own, int(r._row.argmax()), num_blocks,
                                             block_size, sleep=lambda s: None)
            self.engines[rid] = eng
            self.pubs[rid] = self.index.publisher(ReplicaInfo(rid, rid, model_name, 0, block_size))
            run_sync(self.pubs[rid].register())
            self.busy[rid], self.inflight[rid] = False, 0
            self.report[rid] = ReplicaLoad(0, 0, num_blocks, num_blocks, 0.0)
        self.root = root_hash(next(iter(self.engines.values())).identity_digest, "default", "")
        self._events: list = []
        self._seq = itertools.count()

    def _push(self, t: float, kind: str, data) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def run(self, reqs: list[Request], output_tokens: int, concurrency: int = 0) -> list[Result]:
        """Open loop at the requests' offsets, or closed loop with ``concurrency`` clients."""
        results: dict[str, Result] = {}
        self._closed = list(reversed(reqs[concurrency:])) if concurrency else None
        for r in (reqs[:concurrency] if concurrency else reqs):
            self._push(0.0 if concurrency else r.offset_s, "arrive", r)
        while self._events:
            self.clock, _, kind, data = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(data, results, output_tokens)
            else:
                self._step_done(*data, results)
        return [results[str(r.index)] for r in reqs]

    def _arrive(self, r: Request, results: dict, output_tokens: int) -> None:
        chain = block_hash_chain(self.root, r.token_ids, self.block_size)
        rid = self.policy.choose(self._candidates(chain), chain).info.replica_id
        params = SamplingParams.from_proto(_sampling(output_tokens))
        self.engines[rid].add_request(EngineRequest(str(r.index), r.token_ids, params))
        self.inflight[rid] += 1
        results[str(r.index)] = Result(r, rid, len(r.token_ids))
        if not self.busy[rid]:
            self._start_step(rid)

    def _candidates(self, chain: list[bytes]) -> list[Candidate]:
        """Every replica with its load and its device (and node-tier) hits, as the router's
        core builds them."""
        matched = run_sync(self.index.match(chain))
        starts = {rid: (p.replica.kv_tier, matched.get(rid, 0))
                  for rid, p in self.pubs.items() if p.replica.kv_tier}
        host = run_sync(self.index.host_match(chain, starts)) if starts else {}
        return [Candidate(p.replica, self.report[rid], matched.get(rid, 0), self.inflight[rid],
                          report_age_s=self.clock - self.report[rid].updated_at,
                          host_blocks=host.get(rid, 0))
                for rid, p in self.pubs.items()]

    def _start_step(self, rid: str) -> None:
        eng = self.engines[rid]
        before = eng.executor.steps
        outputs = eng.step()
        ran = eng.executor.steps > before
        self.busy[rid] = ran or bool(outputs)
        if self.busy[rid]:
            self._push(self.clock + (eng.executor.last_step_s if ran else 0.0), "step", (rid, outputs))

    def _step_done(self, rid: str, outputs, results: dict) -> None:
        eng = self.engines[rid]
        for o in outputs:
            res = results[o.request_id]
            if res.ttft_s is None and o.token_ids:
                res.ttft_s = self.clock - res.request.offset_s
            if o.finished:
                res.e2e_s = self.clock - res.request.offset_s
                res.cached_tokens = o.usage.cached_prompt_tokens
                self.inflight[rid] -= 1
                if self._closed:
                    nxt = self._closed.pop()
                    self._push(self.clock, "arrive", replace(nxt, offset_s=self.clock))
        stored, removed = eng.kv.take_events()
        run_sync(self.pubs[rid].publish(stored, removed))
        s = eng.stats()
        self.report[rid] = ReplicaLoad(s["running"], s["waiting"], s["num_free_blocks"],
                                       s["num_total_blocks"], self.clock, s["queue_delay_s"],
                                       s["prefill_token_s"])
        self.busy[rid] = False
        if eng.has_work:
            self._start_step(rid)


def _sampling(max_tokens: int):
    from kvfleet.v1 import common_pb2

    p = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return p


def summarize(results: list[Result], warmup: int, replicas: int, duration_s: float) -> dict:
    rs = results[warmup:]
    ttft = sorted(r.ttft_s for r in rs)
    per = {}
    for r in rs:
        per[r.replica] = per.get(r.replica, 0) + 1
    counts = [per.get(k, 0) for k in sorted(set(x.replica for x in results))]
    counts += [0] * (replicas - len(counts))
    busy: dict[str, float] = {}
    for r in rs:
        busy[r.replica] = busy.get(r.replica, 0.0) + r.e2e_s
    loads = [busy.get(k, 0.0) for k in sorted(set(x.replica for x in results))]
    loads += [0.0] * (replicas - len(loads))
    return {
        "n": len(rs),
        "max_load_over_mean": max(loads) / statistics.mean(loads),
        "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "ttft_p99_s": ttft[int(len(ttft) * 0.99)],
        "hit_rate": sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs),
        "max_share_over_mean": max(counts) / statistics.mean(counts),
        "e2e_mean_s": statistics.mean(r.e2e_s for r in rs),
        "duration_s": duration_s,
    }


def main(argv: list[str] | None = None) -> int:
    from kvfleet.deploy.models import prepare_model

    p = argparse.ArgumentParser(prog="bench.sim.fleet_sim", description=__doc__)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=640, help="KV blocks per replica")
    p.add_argument("--zipf", type=float, default=0.0)
    p.add_argument("--rate", type=float, required=True, help="requests/s (simulated clock)")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=0, help="closed loop with this many clients")
    p.add_argument("--policies", default="prefix_aware,least_loaded,round_robin")
    p.add_argument("--calibration", default=str(CALIBRATION),
                   help="cost-model constants (default: measured by bench.engine.calibrate on first use)")
    p.add_argument("--options", default="{}", help="JSON options for prefix_aware")
    a = p.parse_args(argv)
    cost = CostModel.load(ensure_calibration(Path(a.calibration)))
    w = Workload(zipf_s=a.zipf)
    reqs = requests(w, a.rate, a.count)
    for name in a.policies.split(","):
        opts = json.loads(a.options) if name in ("prefix_aware", "predicted_ttft") else {}
        fleet = SimFleet(a.replicas, str(prepare_model(progress=False)), a.blocks, cost,
                         make_policy(name, **opts))
        res = fleet.run(reqs, w.output_tokens, a.concurrency)
        out = summarize(res, a.count // 10, a.replicas, fleet.clock)
        out["throughput_rps"] = len(res) / fleet.clock
        print(name, json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
