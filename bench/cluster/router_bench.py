"""Does prefix-aware routing pay? Policies compared in one run, through the real router, the real
Redis index and real gRPC, on cost-model replicas (or real SmolLM2 replicas), interleaved.

    .venv/bin/python -m bench.cluster.router_bench policies --replicas 4 [--zipf 1.1]
    .venv/bin/python -m bench.cluster.router_bench policies --replicas 32 --scale 0.2
    .venv/bin/python -m bench.cluster.router_bench real

One fleet per policy (same replicas, same KV pools, one router process each, own namespace on
one Redis) stays up for the whole run. First a closed-loop saturation phase per policy (it also
warms the caches) measures throughput; round robin's sets the open-loop rate (``--load`` × its
capacity). Then ``--rounds`` rounds: each round draws one Poisson request stream and replays it
against every policy in turn (the order rotates), so machine noise hits all policies alike; the
per-round ratios give the spread. Results (JSON) and TTFT CDFs (PNG) go to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

from bench.common.load import Target, closed_loop, open_loop
from bench.common.plots import plot_ttft_cdfs
from bench.common.report import ratio_spread, summarize, throughput
from bench.common.result_file import RESULTS
from bench.common.workload import Workload, requests, stream
from bench.engine.calibrate import DEFAULT_OUT as CALIBRATION
from bench.engine.calibrate import ensure_calibration
from kvfleet.worker.executor.cost_model import CostModel

POLICIES = ("prefix_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class Run:
    replicas: int = 4
    executor: str = "cost-model"
    scale: float = 0.05           # cost model time scale (step times × scale)
    num_blocks: int = 640         # KV blocks per replica (block size 16)
    workload: Workload = Workload()
    load: float = 0.7             # open-loop rate as a fraction of round robin's capacity
    rounds: int = 3
    segment: int = 100            # requests per policy per round
    saturation_s: float = 40.0    # closed-loop seconds per policy
    clients_per_replica: int = 6
    max_num_seqs: int = 16
    policies: tuple[str, ...] = POLICIES
    tag: str = ""
    router_args: tuple[str, ...] = ()  # extra router flags, e.g. ("--no-index-mirror",)

    @property
    def name(self) -> str:
        pop = f"zipf{self.workload.zipf_s:g}" if self.workload.zipf_s else "uniform"
        return self.tag or f"{self.executor}-{self.replicas}r-{pop}"


def start_fleets(run: Run, redis_url: str) -> dict:
    from dataclasses import replace

    from kvfleet.deploy.cluster_config import ClusterConfig, router_from_flags
    from kvfleet.deploy.launcher import LocalCluster
    from kvfleet.deploy.models import DEFAULT_MODEL, resolve_model
    from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
    from kvfleet.worker.replica.replica import ReplicaConfig

    name, model_dir = resolve_model(DEFAULT_MODEL)
    cost = (CostModel.load(ensure_calibration()).scaled(run.scale)
            if run.executor == "cost-model" else None)
    fleets = {}
    for policy in run.policies:
        replica = ReplicaConfig(
            name, name, str(model_dir), block_size=16, num_blocks=run.num_blocks,
            redis_url=redis_url, namespace=f"bench-{run.name}-{policy}:",
            scheduler=SchedulerConfig(max_num_seqs=run.max_num_seqs, max_num_batched_tokens=512),
            executor=run.executor, cost_model=cost)
        router = replace(router_from_flags(run.router_args), policy=policy, port=0)
        # Many cost-model replicas share a process (one torch import): routing, not faults.
        cfg = ClusterConfig(replica, router, replicas=run.replicas, replica_num_cpus=0,
                            replicas_per_host=64)
        cluster = LocalCluster(cfg)
        cluster.start()
        fleets[policy] = cluster
    return fleets


async def wait_registered(address: str, n: int, timeout_s: float = 60.0,
                          key: str | None = None) -> list[str]:
    """Until the router lists ``n`` replicas (``key``: an admin's API key, when the router
    has a key file: ClusterStatus is for admins only); returns their ids."""
    import grpc

    from kvfleet.v1 import router_pb2, router_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            md = (("authorization", f"Bearer {key}"),) if key else None
            s = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), metadata=md)
            if len(s.replicas) == n:
                return [r.replica_id for r in s.replicas]
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{address}: {n} replicas did not register")


async def drive(run: Run, addresses: dict[str, str]) -> dict:
    w = run.workload
    targets = {p: Target(a, max_tokens=w.output_tokens) for p, a in addresses.items()}
    replica_ids = {p: await wait_registered(a, run.replicas) for p, a in addresses.items()}
    sat, sat_stats = {}, {}
    for i, p in enumerate(run.policies):  # saturation (and warm-up), same stream for each
        res = await closed_loop(targets[p], stream(w, seed=7), run.clients_per_replica * run.replicas,
                                run.saturation_s)
        sat[p] = throughput(res, run.saturation_s / 3)
        sat_stats[p] = summarize([r for r in res if r.sent >= res[0].sent + run.saturation_s / 3],
                                 replica_ids[p])
        print(f"saturation {p}: {sat[p]:.2f} req/s, hit {sat_stats[p].get('hit_rate', 0):.3f}",
              flush=True)
    rate = run.load * sat["round_robin"] if "round_robin" in sat else run.load * min(sat.values())
    per_round: dict[str, list] = {p: [] for p in run.policies}
    for r in range(run.rounds):
        reqs = requests(w, rate, run.segment, seed=1000 + r)
        order = run.policies[r % len(run.policies):] + run.policies[:r % len(run.policies)]
        for p in order:
            res = await open_loop(targets[p], reqs)
            per_round[p].append(res)
            s = summarize(res, replica_ids[p])
            print(f"round {r} {p}: ttft p50 {s.get('ttft_p50_s', 0) * 1e3:.0f} ms, p99 "
                  f"{s.get('ttft_p99_s', 0) * 1e3:.0f} ms, hit {s.get('hit_rate', 0):.3f}, "
                  f"busiest {s.get('busiest_load_over_mean', 0):.2f}", flush=True)
    for t in targets.values():
        await t.close()
    return {"rate_per_s": rate, "saturation_per_s": sat, "saturation": sat_stats,
            "per_round": per_round, "replica_ids": replica_ids}


def analyse(run: Run, raw: dict) -> dict:
    ids = raw["replica_ids"]
    combined = {p: summarize([x for rnd in raw["per_round"][p] for x in rnd], ids[p])
                for p in run.policies}
    ratios = {}
    if "round_robin" in run.policies:
        for p in run.policies:
            rounds = [(summarize(a, ids[p]), summarize(b, ids["round_robin"]))
                      for a, b in zip(raw["per_round"][p], raw["per_round"]["round_robin"])]
            ratios[p] = {k: ratio_spread([x[k] / y[k] for x, y in rounds if y.get(k)])
                         for k in ("ttft_p50_s", "ttft_p99_s", "hit_rate")}
            ratios[p]["saturation_throughput"] = (raw["saturation_per_s"][p]
                                                  / raw["saturation_per_s"]["round_robin"])
    return {"policies": combined, "ratios_vs_round_robin": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.router_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pol = sub.add_parser("policies", help="cost-model replicas (default) through the router")
    real = sub.add_parser("real", help="2 real SmolLM2 replicas, a smaller workload")
    for q in (pol, real):
        q.add_argument("--zipf", type=float, default=0.0)
        q.add_argument("--rounds", type=int)
        q.add_argument("--segment", type=int)
        q.add_argument("--saturation-s", type=float)
        q.add_argument("--tag", default="")
        q.add_argument("--policies", help="comma-separated (default: all three)")
        q.add_argument("--router-arg", action="append", default=[], dest="router_args",
                       help="extra router flag, repeatable (e.g. --router-arg=--no-index-mirror)")
    pol.add_argument("--replicas", type=int, default=4)
    pol.add_argument("--scale", type=float, default=0.05)
    a = p.parse_args(argv)
    if a.cmd == "policies":
        run = Run(replicas=a.replicas, scale=a.scale, workload=Workload(zipf_s=a.zipf), tag=a.tag)
    else:  # 8 groups × 256-token prefix; like the main run, the fleet's KV holds 1.25× the
        # prefixes (2 replicas × 80 blocks), so one replica's pressure is 2 / 1.25 = 1.6
        run = Run(replicas=2, executor="model", num_blocks=80, clients_per_replica=2,
                  workload=Workload(groups=8, prefix_tokens=256, suffix_tokens=32,
                                    output_tokens=4, zipf_s=a.zipf),
                  rounds=3, segment=20, saturation_s=120.0, tag=a.tag)
    overrides = {k: v for k, v in (("rounds", a.rounds), ("segment", a.segment),
                                   ("saturation_s", a.saturation_s)) if v is not None}
    if a.policies:
        overrides["policies"] = tuple(a.policies.split(","))
    if a.router_args:
        overrides["router_args"] = tuple(a.router_args)
    run = Run(**{**asdict(run), "workload": run.workload, **overrides})
    return bench(run)


def bench(run: Run) -> int:
    from kvfleet.deploy.ray_local import init_ray, shutdown_ray
    from kvfleet.deploy.redis_server import start_redis

    load_before = os.getloadavg()
    redis = start_redis()
    init_ray(num_cpus=2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # after Ray's: clean up on kill
    fleets = {}
    try:
        fleets = start_fleets(run, redis.url)
        raw = asyncio.run(drive(run, {p: c.router_address for p, c in fleets.items()}))
    finally:
        for c in fleets.values():
            c.stop()
        redis.stop()
        shutdown_ray()
    out = analyse(run, raw)
    w = run.workload
    record = {
        "run": {**asdict(run), "name": run.name},
        "cache_pressure": w.cache_pressure(16, run.num_blocks),
        "cost_model": (CostModel.load(CALIBRATION).scaled(run.scale).to_json()
                       if run.executor == "cost-model" else None),
        "calibration": json.loads(CALIBRATION.read_text()) if run.executor == "cost-model" else None,
        "open_loop_rate_per_s": raw["rate_per_s"],
        "saturation_per_s": raw["saturation_per_s"], "saturation": raw["saturation"],
        **out,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{run.name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    ttfts = {p: [x.ttft_s for rnd in raw["per_round"][p] for x in rnd if x.ok] for p in run.policies}
    title = (f"{run.name}: {w.groups} groups × {w.prefix_tokens}+{w.suffix_tokens} tokens, "
             f"{run.replicas} replicas, cache pressure {record['cache_pressure']:.1f}, "
             f"{raw['rate_per_s']:.2f} req/s")
    plot_ttft_cdfs(ttfts, RESULTS / f"{run.name}-ttft-cdf.png", title)
    print(json.dumps({"cache_pressure": record["cache_pressure"], **out}, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
