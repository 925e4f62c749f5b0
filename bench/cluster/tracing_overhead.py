"""Tracing overhead: serving throughput with telemetry on vs off, interleaved rounds.

    .venv/bin/python -m bench.cluster.tracing_overhead            # the prepared SmolLM2 (default model)
    .venv/bin/python -m bench.cluster.tracing_overhead --tiny     # a seeded tiny Llama: the worst case,
                                                          # its forward is ~1 ms, so the serving
                                                          # path's own costs weigh the most

Two local clusters share one Ray and one Redis; each is one replica (the real engine) behind
its own router process. "off" configures nothing (OpenTelemetry's no-op tracer and meter);
"on" exports every span and metric over OTLP/gRPC to an in-process collector
(:mod:`kvfleet.telemetry.collector`) with the SDK's batching, and serves Prometheus. Rounds
run in ABBA order (off on, on off, …) so drift hits both arms alike; in a round, ``clients``
concurrent streams each send ``requests`` requests of fixed token ids (greedy, ``ignore_eos``,
``max_tokens`` new tokens). Throughput = generated tokens / wall seconds. The two arms see the
same prompts in the same pair of rounds, distinct from every other round's (no prefix reuse
across rounds).

Throughput on a shared machine moves with everyone else's load, so two steadier measures
come with it: the CPU seconds the router and replica processes spend per generated token in
each round (user + system, from /proc; what throughput is bounded by once CPU-bound), and,
in-process, the CPU time telemetry adds per request (router + worker spans and metrics, the
export thread included) against the no-op arm.

Reports each arm's median/min/max, the median and range of per-pair ratios, and the cost
``1 − median(on) / median(off)``; writes ``bench/results/tracing_overhead[_tiny].json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common.result_file import RESULTS
from kvfleet.client import AsyncClient
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.deploy.launcher import LocalCluster
from kvfleet.deploy.ray_local import init_ray, shutdown_ray
from kvfleet.deploy.redis_server import start_redis
from kvfleet.router.config import RouterConfig
from kvfleet.telemetry import Telemetry, TelemetryConfig
from kvfleet.telemetry.collector import OtlpSink
from kvfleet.telemetry.names import MD_WORKER_DURATION_S
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.replica.replica import ReplicaConfig

TOKEN_RANGE = (1000, 40000)  # plain tokens of SmolLM2's vocabulary


def prompts(pair: int, clients: int, per_client: int, length: int) -> list[list[list[int]]]:
    rng = random.Random(1000 + pair)
    return [[[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(per_client)]
            for _ in range(clients)]


async def one_round(address: str, batch: list[list[list[int]]], max_tokens: int) -> tuple[int, float]:
    """Stream every prompt (one task per client, its prompts in turn); (tokens, seconds)."""
    async with AsyncClient(address) as client:
        async def run(mine):
            n = 0
            for ids in mine:
                async for chunk in client.stream(token_ids=ids, max_tokens=max_tokens,
                                                 ignore_eos=True, temperature=0.0):
                    n += len(chunk.token_ids)
            return n

        start = time.monotonic()
        counts = await asyncio.gather(*(run(mine) for mine in batch))
        return sum(counts), time.monotonic() - start


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def server_pids(cluster: LocalCluster) -> list[int]:
    return [cluster.router_proc.pid, *cluster.replica_pids()]


def micro_cost_us(n: int, sink_endpoint: str) -> dict:
    """CPU µs per request that router + worker telemetry add, exporting vs no-op."""
    from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
    from kvfleet.router.core import RouteDecision
    from kvfleet.router.policy import Candidate
    from kvfleet.sampling_params import SamplingParams
    from kvfleet.telemetry.router_spans import RouterTelemetry
    from kvfleet.telemetry.worker_spans import WorkerTelemetry
    from kvfleet.v1 import common_pb2, worker_pb2
    from kvfleet.worker.engine.output.outputs import Milestones, SeqOutput, Usage
    from kvfleet.worker.engine.request import FinishReason

    candidates = tuple(Candidate(ReplicaInfo(f"r{i}", "a", "m", 1, 16),
                                 ReplicaLoad(1, 0, 10, 10, 0.0), 3 if i == 0 else 0, 0)
                       for i in range(4))  # a 4-replica fleet: 4 candidate strings per route
    decision = RouteDecision(candidates[0], num_blocks=5, redis_s=0.0002, index_used=True,
                             index_source="mirror", candidates=candidates)
    last = common_pb2.GenerateResponse(finish_reason=common_pb2.LENGTH, usage=common_pb2.Usage(
        prompt_tokens=80, cached_prompt_tokens=32, completion_tokens=32))
    req = worker_pb2.WorkerGenerateRequest(request_id="x", prompt_token_ids=[7] * 80)
    req.sampling.max_tokens = 32
    params = SamplingParams(max_tokens=32)

    async def run(cfg: TelemetryConfig) -> float:
        rtel, wtel = Telemetry(cfg, "router"), Telemetry(cfg, "worker")
        rt = RouterTelemetry(rtel)
        wt = WorkerTelemetry(wtel, "r", "m", stats_fn=lambda: {"running": 1, "waiting": 0,
                                                                "num_free_blocks": 1,
                                                                "num_total_blocks": 2})
        start = time.process_time()  # every thread of this process: export threads included
        for i in range(n):
            with rt.request((), "text") as t:
                t.on_request("m", params, "default")
                with t.tokenize() as tok:
                    tok["tokens"] = 80
                t.routed(time.monotonic(), decision, "prefix_aware")
                md = t.start_dispatch(f"q{i}", "r", "a")
                req.request_id = f"q{i}"
                with wt.start(req, md) as w:
                    now = time.monotonic()
                    wt.on_finished(SeqOutput(f"q{i}", 0, (1,), "", finish_reason=FinishReason.LENGTH,
                                             usage=Usage(80, 32, 32),
                                             milestones=Milestones(now, now, now, now, now,
                                                                   ((now, 48),))))
                    worker_s = w.handler_done()
                t.on_final(last)
                t.dispatched(((MD_WORKER_DURATION_S, f"{worker_s:.6f}"),))
        rtel.shutdown()
        wtel.shutdown()  # flushes: the export cost is counted
        return (time.process_time() - start) / n * 1e6

    off = asyncio.run(run(TelemetryConfig()))
    on = asyncio.run(run(TelemetryConfig(otlp_endpoint=sink_endpoint, metric_export_interval_s=1.0)))
    return {"requests": n, "off_us": off, "on_us": on, "added_us": on - off}


def tiny_model_dir() -> str:
    """The seeded tiny Llama the tests use (needs the dev extra: transformers)."""
    from kvfleet.deploy.models import prepare_model
    from tests.fixtures.models import write_tiny_model

    out = Path(tempfile.mkdtemp(prefix="kvf-bench-tiny-"))
    return str(write_tiny_model(out, "llama", prepare_model(progress=False)))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}


def summarize(results: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict:
    off, on = results["off"], results["on"]
    ratios = [b / a for a, b in zip(off, on)]
    cpu_ratios = [b / a for a, b in zip(cpu["off"], cpu["on"])]
    return {
        "off_tokens_per_s": spread(off), "on_tokens_per_s": spread(on),
        "pair_ratio_on_off": spread(ratios),
        "cost": 1.0 - statistics.median(on) / statistics.median(off),
        "off_cpu_ms_per_token": spread(cpu["off"]), "on_cpu_ms_per_token": spread(cpu["on"]),
        "pair_cpu_ratio_on_off": spread(cpu_ratios),
        "cpu_cost": statistics.median(cpu["on"]) / statistics.median(cpu["off"]) - 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.tracing_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds per arm (default 6, min 5)")
    p.add_argument("--clients", type=int, default=8, help="concurrent streams (default 8)")
    p.add_argument("--requests", type=int, default=2, help="requests per stream per round")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="serve the seeded tiny Llama")
    p.add_argument("--model", help="model name or HF directory (default: SmolLM2)")
    p.add_argument("--micro-requests", type=int, default=2000)
    p.add_argument("--out", type=Path, help="JSON report (default bench/results/"
                   "tracing_overhead[_tiny].json)")
    a = p.parse_args(argv)
    if a.rounds < 5:
        p.error("--rounds must be >= 5")
    from kvfleet.deploy.models import resolve_model

    if a.tiny:
        name, model_dir = "tiny-llama", tiny_model_dir()
    else:
        name, model_dir = resolve_model(a.model or "smollm2-135m-instruct")
    load_before = os.getloadavg()
    init_ray(num_cpus=os.cpu_count() or 2)
    sink, redis = OtlpSink(), start_redis()
    sink.start()
    arms = {"off": TelemetryConfig(),
            "on": TelemetryConfig(otlp_endpoint=sink.endpoint, metric_export_interval_s=5.0)}
    clusters: dict[str, LocalCluster] = {}
    try:
        for arm, tcfg in arms.items():
            clusters[arm] = LocalCluster(ClusterConfig(
                ReplicaConfig(name, name, str(model_dir), redis_url=redis.url,
                              namespace=f"kvbench-trace-{arm}:", telemetry=tcfg,
                              scheduler=SchedulerConfig(max_num_seqs=max(16, a.clients))),
                RouterConfig(port=0), replicas=1, replica_num_cpus=0,
                metrics_port=0 if arm == "on" else None))
            clusters[arm].start()
        for arm, c in clusters.items():  # warm-up: first-request costs, lazy imports
            asyncio.run(one_round(c.router_address, prompts(-1, a.clients, 1, a.prompt_tokens),
                                  a.max_tokens))
        pids = {arm: server_pids(c) for arm, c in clusters.items()}
        results: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        for pair in range(a.rounds):
            batch = prompts(pair, a.clients, a.requests, a.prompt_tokens)
            for arm in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                cpu0 = cpu_seconds(pids[arm])
                tokens, seconds = asyncio.run(one_round(clusters[arm].router_address, batch,
                                                        a.max_tokens))
                cpu[arm].append((cpu_seconds(pids[arm]) - cpu0) / tokens * 1e3)
                results[arm].append(tokens / seconds)
                print(f"round {pair} {arm:>3}: {tokens} tokens in {seconds:.2f} s = "
                      f"{tokens / seconds:.1f} tokens/s, {cpu[arm][-1]:.2f} CPU ms/token",
                      flush=True)
    finally:
        for c in clusters.values():
            c.stop()
        redis.stop()
        shutdown_ray()
    spans = len(sink.spans())
    micro = micro_cost_us(a.micro_requests, sink.endpoint)
    sink.stop()
    report = {"model": name, "rounds_per_arm": a.rounds, "clients": a.clients,
              "requests_per_client": a.requests, "prompt_tokens": a.prompt_tokens,
              "max_tokens": a.max_tokens, "spans_exported": spans,
              **summarize(results, cpu), "micro": micro,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()}}
    s = report
    print(f"\n{name}: off {s['off_tokens_per_s']['median']:.1f} tokens/s "
          f"[{s['off_tokens_per_s']['min']:.1f}–{s['off_tokens_per_s']['max']:.1f}], "
          f"on {s['on_tokens_per_s']['median']:.1f} "
          f"[{s['on_tokens_per_s']['min']:.1f}–{s['on_tokens_per_s']['max']:.1f}] (median [min–max] "
          f"of {a.rounds} rounds each)")
    r = s["pair_ratio_on_off"]
    print(f"cost of tracing: {s['cost'] * 100:+.2f} % of throughput (1 − median on / median off); "
          f"per-pair on/off ratio median {r['median']:.4f} [{r['min']:.4f}–{r['max']:.4f}]")
    c = s["pair_cpu_ratio_on_off"]
    print(f"router + replica CPU per token: off {s['off_cpu_ms_per_token']['median']:.2f} ms, on "
          f"{s['on_cpu_ms_per_token']['median']:.2f} ms → {s['cpu_cost'] * 100:+.2f} %; per-pair "
          f"on/off median {c['median']:.4f} [{c['min']:.4f}–{c['max']:.4f}]")
    print(f"CPU per request (in-process, {micro['requests']} requests): no-op "
          f"{micro['off_us']:.0f} µs, exporting {micro['on_us']:.0f} µs → +{micro['added_us']:.0f} µs")
    print(f"load average before {load_before}, after {report['machine']['loadavg_after']}")
    out = a.out or RESULTS / ("tracing_overhead_tiny.json" if a.tiny else "tracing_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
