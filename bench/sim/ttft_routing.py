"""Routing by predicted TTFT: ``predicted_ttft`` vs ``prefix_aware`` vs
``round_robin`` on the virtual-time fleet (``bench.sim.fleet_sim``: real engines, schedulers and
prefix caches, cost-model step times on a simulated clock), one workload at a time:

* ``uniform``: the router bench's workload (32 groups × 1,024 + 64 tokens), 4 equal replicas;
* ``hetero``: the same, replica 0 at half speed (its cost model × 2);
* ``b2b``: the llm-d "B2B" shape — 8 groups × 2,048-token system prompt (more than one
  replica's share of its KV per group), 4 users per group with 256 tokens of their own context,
  a warm-up phase at 0.3× (not measured: every policy pays the same cold prefills there), then
  arrivals ramped 0.3 → 1.3× prefix_aware's saturation throughput.

Per workload: a closed-loop saturation run per policy (``6 × replicas`` clients): its
throughput over the whole run, and over the second half of the completions (past the cold
start: the steady state b2b ramps against); then, for each of ``--seeds`` request
streams, every policy replays the same open-loop stream (``--load`` × prefix_aware's
saturation; the ramp for ``b2b``). The TTFT ratios against ``prefix_aware`` are taken per seed
(same stream) and reported as mean, standard deviation, min and max over the seeds.
``round_robin`` runs on the first seed only (a far baseline). Results go to
``bench/results/ttft_routing.json``.

    .venv/bin/python -m bench ttft_routing [--workloads uniform,hetero,b2b] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common.result_file import write_json
from bench.common.workload import B2BWorkload, Request, Workload, b2b_requests, requests
from bench.engine.calibrate import DEFAULT_OUT as CALIBRATION
from bench.engine.calibrate import ensure_calibration
from bench.sim.fleet_sim import Result, SimFleet, summarize
from kvfleet.router.policy import make_policy
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import MEASURED, CostModel

POLICIES = ("predicted_ttft", "prefix_aware", "round_robin")
FAR_BASELINES = ("round_robin",)  # first seed only
WARM_UP = 0.3  # b2b: an unmeasured phase at this × the saturation throughput, before the ramp
RAMP = (0.3, 0.55, 0.8, 1.05, 1.3)  # b2b: measured phases, × prefix_aware's saturation
QUANTILES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")


@dataclass(frozen=True)
class Case:
    name: str
    scales: tuple[float, ...] = ()
    b2b: bool = False


CASES = {"uniform": Case("uniform"), "hetero": Case("hetero", scales=(2.0,)),
         "b2b": Case("b2b", b2b=True)}


def stream(case: Case, rate: float, count: int, seed: int) -> tuple[list[Request], int]:
    """``count`` requests of ``case``'s workload at ``rate`` per second (b2b: the warm-up and
    the ramp, in multiples of ``rate``) and how many leading ones are warm-up."""
    if case.b2b:
        per = max(1, count // (1 + len(RAMP)))
        phases = [(f * rate, per) for f in (WARM_UP, *RAMP)]
        return b2b_requests(B2BWorkload(), phases, seed=seed), per
    return requests(Workload(), rate, count, seed=seed), count // 10


def output_tokens(case: Case) -> int:
    return B2BWorkload().output_tokens if case.b2b else Workload().output_tokens


def steady_throughput(results: list[Result]) -> float:
    """Completions per second over the second half of a closed loop's completions (the first
    half holds the cold start: every prefix computed once)."""
    ends = sorted(r.request.offset_s + (r.e2e_s or 0.0) for r in results)
    half = len(ends) // 2
    return (len(ends) - 1 - half) / max(1e-9, ends[-1] - ends[half])


def phase_p90s(results: list[Result], warm: int, phases: int) -> list[float]:
    """TTFT p90 of each of ``phases`` equal runs of requests after the ``warm`` first."""
    per = (len(results) - warm) // phases
    out = []
    for k in range(phases):
        t = sorted(r.ttft_s or 0.0 for r in results[warm + k * per:warm + (k + 1) * per])
        out.append(t[int(len(t) * 0.9)])
    return out


def spread(values: list[float]) -> dict:
    """mean, geometric mean, sd (0 for one value), min and max of positive ``values``."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.mean(values), "geomean": statistics.geometric_mean(values),
            "sd": sd, "min": min(values), "max": max(values), "per_seed": values}


def run_case(case: Case, args, cost: CostModel, model_dir: str) -> dict:
    def fleet(policy: str) -> SimFleet:
        opts = json.loads(args.ttft_options) if policy == "predicted_ttft" else {}
        return SimFleet(args.replicas, model_dir, args.blocks, cost, make_policy(policy, **opts),
                        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                        scales=case.scales)

    out: dict = {"saturation_rps": {}, "steady_saturation_rps": {}, "saturation_hit_rate": {},
                 "seeds": []}
    sat_reqs, _ = stream(case, 1.0, args.saturation_count, seed=7)
    for p in args.policies:
        f = fleet(p)
        res = f.run(sat_reqs, output_tokens(case), concurrency=6 * args.replicas)
        out["saturation_rps"][p] = len(res) / f.clock
        out["steady_saturation_rps"][p] = steady_throughput(res)
        out["saturation_hit_rate"][p] = summarize(res, len(res) // 2, args.replicas, f.clock)["hit_rate"]
    # The anchor is prefix_aware's. b2b ramps past its steady state (its whole run, half
    # cold 2,368-token prefills, is about half of it: a ramp to 1.3× that never saturates).
    sat = out["steady_saturation_rps" if case.b2b else "saturation_rps"]
    base = sat.get("prefix_aware", max(sat.values()))
    out["rate_rps"] = rate = base if case.b2b else args.load * base
    for k in range(args.seeds):
        reqs, warm = stream(case, rate, args.count, seed=args.first_seed + k)
        runs = {}
        for p in args.policies:
            if k and p in FAR_BASELINES:
                continue
            f = fleet(p)
            res = f.run(reqs, output_tokens(case))
            runs[p] = summarize(res, warm, args.replicas, f.clock)
            if case.b2b:
                runs[p]["phase_ttft_p90_s"] = phase_p90s(res, warm, len(RAMP))
        out["seeds"].append(runs)
    out["open_loop"] = _aggregate(out["seeds"])
    return out


def _aggregate(seeds: list[dict]) -> dict:
    """Per policy: its measures averaged over the seeds it ran, and (where ``prefix_aware``
    ran) the per-seed ratios of its TTFT quantiles to prefix_aware's, with their spread."""
    agg: dict = {}
    for p in seeds[0]:
        runs = [s[p] for s in seeds if p in s]
        agg[p] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]
                  if isinstance(runs[0][k], float)}
        if "phase_ttft_p90_s" in runs[0]:
            agg[p]["phase_ttft_p90_s"] = [statistics.mean(v) for v in
                                          zip(*(r["phase_ttft_p90_s"] for r in runs))]
        agg[p]["seeds"] = len(runs)
        if all("prefix_aware" in s for s in seeds if p in s):
            agg[p]["vs_prefix_aware"] = {
                q: spread([s[p][q] / s["prefix_aware"][q] for s in seeds if p in s])
                for q in QUANTILES}
    return agg


def main(argv: list[str] | None = None) -> int:
    from kvfleet.deploy.models import prepare_model

    p = argparse.ArgumentParser(prog="bench.sim.ttft_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(CASES))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=640, help="KV blocks per replica")
    p.add_argument("--count", type=int, default=480,
                   help="open-loop requests per policy and seed (b2b: with the warm-up)")
    p.add_argument("--seeds", type=int, default=3, help="open-loop request streams")
    p.add_argument("--first-seed", type=int, default=1000, help="seed of the first stream")
    p.add_argument("--saturation-count", type=int, default=300)
    p.add_argument("--load", type=float, default=0.8,
                   help="open-loop rate ÷ prefix_aware's saturation throughput (not b2b)")
    p.add_argument("--scale", type=float, default=0.05, help="cost-model time scale")
    p.add_argument("--calibration", default="measured",
                   help="'measured' (the constants in step_cost.MEASURED, the same on every "
                        f"machine) or a calibration JSON, e.g. {CALIBRATION} (bench.engine.calibrate)")
    p.add_argument("--ttft-options", default="{}", help="JSON options for predicted_ttft")
    a = p.parse_args(argv)
    a.policies = tuple(a.policies.split(","))
    unknown = sorted(set(a.workloads.split(",")) - set(CASES))
    if unknown:
        p.error(f"--workloads: unknown {unknown}; known: {sorted(CASES)}")
    if a.seeds < 1:
        p.error("--seeds: need at least 1")
    prior = MEASURED if a.calibration == "measured" \
        else CostModel.load(ensure_calibration(Path(a.calibration)))
    cost = prior.scaled(a.scale)
    model_dir = str(prepare_model(progress=False))
    record: dict = {"args": {k: v for k, v in vars(a).items()}, "cost_model": cost.to_json(),
                    "workloads": {}}
    for name in a.workloads.split(","):
        t0 = time.monotonic()
        r = run_case(CASES[name], a, cost, model_dir)
        record["workloads"][name] = r
        for pol, s in r["open_loop"].items():
            ratio = s.get("vs_prefix_aware", {}).get("ttft_p90_s")
            vs = "" if ratio is None else (
                f"  p90 ÷ prefix_aware {ratio['mean']:.2f} ± {ratio['sd']:.2f} (geomean "
                f"{ratio['geomean']:.2f}) [{ratio['min']:.2f}, {ratio['max']:.2f}]")
            print(f"{name:8s} {pol:15s} ttft p50 {s['ttft_p50_s']:6.2f} s  p90 "
                  f"{s['ttft_p90_s']:6.2f} s  p99 {s['ttft_p99_s']:6.2f} s  hit "
                  f"{s['hit_rate']:.3f}  sat {r['saturation_rps'][pol]:5.2f} "
                  f"(steady {r['steady_saturation_rps'][pol]:5.2f}) req/s  "
                  f"({s['seeds']} seeds){vs}", flush=True)
        print(f"{name}: {time.monotonic() - t0:.0f} s wall", flush=True)
    write_json("ttft_routing.json", record, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
