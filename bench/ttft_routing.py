"""Routing by predicted TTFT (issue 25 §4): ``predicted_ttft`` vs ``prefix_aware`` vs
``round_robin`` on the virtual-time fleet (``bench.fleet_sim``: real engines, schedulers and
prefix caches, cost-model step times on a simulated clock), one workload at a time:

* ``uniform``: the router bench's workload (32 groups × 1,024 + 64 tokens), 4 equal replicas;
* ``hetero``: the same, replica 0 at half speed (its cost model × 2);
* ``b2b``: the llm-d "B2B" shape — 8 groups × 2,048-token system prompt (more than one
  replica's share of its KV per group), 4 users per group with 256 tokens of their own context,
  arrivals ramped from 0.3× to 1.3× prefix_aware's capacity.

Per workload and policy: a closed-loop saturation run (``6 × replicas`` clients) gives the
throughput; then every policy replays the same open-loop request stream (``--load`` ×
prefix_aware's throughput; the ramp for ``b2b``). Ratios are against ``prefix_aware`` in the same run.
Results go to ``bench/results/ttft_routing.json``.

    .venv/bin/python -m bench ttft_routing [--workloads uniform,hetero,b2b] [--count 600]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench.calibrate import DEFAULT_OUT as CALIBRATION
from bench.calibrate import ensure_calibration
from bench.fleet_sim import SimFleet, summarize
from bench.result_file import write_json
from bench.workload import B2BWorkload, Request, Workload, b2b_requests, requests
from kvfleet.router.policy import make_policy
from kvfleet.worker.engine.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel

POLICIES = ("predicted_ttft", "prefix_aware", "round_robin")
RAMP = (0.3, 0.55, 0.8, 1.05, 1.3)  # b2b: phases, × prefix_aware's saturation throughput


@dataclass(frozen=True)
class Case:
    name: str
    scales: tuple[float, ...] = ()
    b2b: bool = False


CASES = {"uniform": Case("uniform"), "hetero": Case("hetero", scales=(2.0,)),
         "b2b": Case("b2b", b2b=True)}


def stream(case: Case, rate: float, count: int, seed: int) -> list[Request]:
    """``count`` requests of ``case``'s workload at ``rate`` per second (b2b: the ramp, in
    multiples of ``rate``)."""
    if case.b2b:
        per = max(1, count // len(RAMP))
        return b2b_requests(B2BWorkload(), [(f * rate, per) for f in RAMP], seed=seed)
    return requests(Workload(), rate, count, seed=seed)


def output_tokens(case: Case) -> int:
    return B2BWorkload().output_tokens if case.b2b else Workload().output_tokens


def run_case(case: Case, args, cost: CostModel, model_dir: str) -> dict:
    def fleet(policy: str) -> SimFleet:
        opts = json.loads(args.ttft_options) if policy == "predicted_ttft" else {}
        return SimFleet(args.replicas, model_dir, args.blocks, cost, make_policy(policy, **opts),
                        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                        scales=case.scales)

    out: dict = {"saturation_rps": {}, "saturation_hit_rate": {}, "open_loop": {}}
    sat_reqs = stream(case, 1.0, args.saturation_count, seed=7)
    for p in args.policies:
        f = fleet(p)
        res = f.run(sat_reqs, output_tokens(case), concurrency=6 * args.replicas)
        s = summarize(res, len(res) // 4, args.replicas, f.clock)
        out["saturation_rps"][p] = len(res) / f.clock
        out["saturation_hit_rate"][p] = s["hit_rate"]
    sat = out["saturation_rps"]
    # Rates in multiples of the saturation throughput of the policy compared with (round
    # robin's would leave prefix-aware fleets nearly idle): b2b ramps past it.
    base = sat.get("prefix_aware", max(sat.values()))
    rate = base if case.b2b else args.load * base
    out["rate_rps"] = rate
    reqs = stream(case, rate, args.count, seed=1000)
    for p in args.policies:
        f = fleet(p)
        res = f.run(reqs, output_tokens(case))
        out["open_loop"][p] = summarize(res, len(res) // 10, args.replicas, f.clock)
    if "prefix_aware" in args.policies:
        pa = out["open_loop"]["prefix_aware"]
        out["vs_prefix_aware"] = {p: {k: s[k] / pa[k] for k in ("ttft_p50_s", "ttft_p90_s",
                                                                 "ttft_p99_s")}
                                  for p, s in out["open_loop"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    from kvfleet.deploy.models import prepare_model

    p = argparse.ArgumentParser(prog="bench.ttft_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(CASES))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=640, help="KV blocks per replica")
    p.add_argument("--count", type=int, default=600, help="open-loop requests per policy")
    p.add_argument("--saturation-count", type=int, default=300)
    p.add_argument("--load", type=float, default=0.8,
                   help="open-loop rate ÷ prefix_aware's saturation throughput (not b2b)")
    p.add_argument("--scale", type=float, default=0.05, help="cost-model time scale")
    p.add_argument("--calibration", default=str(CALIBRATION))
    p.add_argument("--ttft-options", default="{}", help="JSON options for predicted_ttft")
    a = p.parse_args(argv)
    a.policies = tuple(a.policies.split(","))
    unknown = sorted(set(a.workloads.split(",")) - set(CASES))
    if unknown:
        p.error(f"--workloads: unknown {unknown}; known: {sorted(CASES)}")
    cost = CostModel.load(ensure_calibration(Path(a.calibration))).scaled(a.scale)
    model_dir = str(prepare_model(progress=False))
    record: dict = {"args": {k: v for k, v in vars(a).items()}, "cost_model": cost.to_json(),
                    "workloads": {}}
    for name in a.workloads.split(","):
        t0 = time.monotonic()
        r = run_case(CASES[name], a, cost, model_dir)
        record["workloads"][name] = r
        for pol, s in r["open_loop"].items():
            ratio = r.get("vs_prefix_aware", {}).get(pol, {}).get("ttft_p90_s", float("nan"))
            print(f"{name:8s} {pol:15s} ttft p50 {s['ttft_p50_s']:7.2f} s  p90 "
                  f"{s['ttft_p90_s']:7.2f} s  p99 {s['ttft_p99_s']:7.2f} s  hit "
                  f"{s['hit_rate']:.3f}  sat {r['saturation_rps'][pol]:.2f} req/s  "
                  f"p90 ÷ prefix_aware {ratio:.2f}", flush=True)
        print(f"{name}: {time.monotonic() - t0:.0f} s wall", flush=True)
    write_json("ttft_routing.json", record, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
