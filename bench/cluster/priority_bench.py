"""Priority classes: an interactive trickle beside a 10x batch flood keeps its TTFT.

    .venv/bin/python -m bench priority  # 2 replicas, 10x batch flood
    .venv/bin/python -m bench priority --batch-share 0.75 --router-arg=--priority-admit=batch=0.8

The cluster of ``bench.cluster.overload`` (cost-model replicas: real router process, scheduler, block
pool, Redis, gRPC; only the forward is a modelled sleep) is started once; in one run:

1. ``capacity``: completions/s with ``replicas × max_num_seqs`` closed-loop clients;
2. ``interactive_alone``: Poisson arrivals at ``--interactive-share`` of capacity, class
   ``interactive`` (its unloaded TTFT);
3. ``batch_alone``: Poisson arrivals at ``--factor ×`` capacity, class ``batch`` (its
   throughput with the fleet to itself; the router refuses what exceeds batch's admission);
4. ``both``: the two streams together, each in its class;
5. ``both_unclassed``: the same two streams with every request in class ``default`` (what
   kvfleet did before classes), for comparison.

Targets (``targets`` in the JSON): interactive TTFT p99 in ``both`` ≤ 1.5× its value in
``interactive_alone``, and batch loses no more replica-seconds than the interactive requests
consume. Both in replica-seconds a second over a phase's middle half, read from the replicas'
own per-class counter (``kvfleet_worker_replica_time_seconds_total``: each step's measured
forward seconds shared among its rows, summed by class; the cluster exports it with
``metrics_port=0``) at the half's two edges: batch's alone less beside the trickle ≤ the
trickle's own beside the flood. The same from the requests that finished in the middle half
(each at its whole ``Timing.replica_s``) is kept beside it, not judged. The same in admitted
completions (lost completions/s ÷ interactive completions/s; every request has the same size)
is kept beside it, not judged: every admitted request completes, the flood's backlog after the
phase, so it counts the router's admissions; and an interactive request, served in smaller
steps, costs the replica more than a batch one (docs/slo.md, "Replica-seconds per request").
JSON goes to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict

import grpc

from bench.cluster.overload import (ProcStats, Run, capacity, counter_by_label, local_cluster,
                                    replica_metric_texts, send, summarize)
from bench.common.result_file import RESULTS
from kvfleet.grpc_util import CHANNEL_OPTIONS
from kvfleet.v1 import router_pb2, router_pb2_grpc

KEYS = {"key-chat": {"tenant": "chat", "priority": "interactive"},
        "key-batch": {"tenant": "batch", "priority": "batch"},
        # the unclassed phase: a batch key's class is a ceiling, so "default" needs its own key
        "key-batch-default": {"tenant": "batch", "priority": "default"}}


CLASS_LABEL, MODEL_LABEL = "kvfleet_request_priority_class", "gen_ai_request_model"
# counters summed over the replicas: name in the result → (exposition name, label summed by)
STEP_COUNTERS = {"forward_s": ("kvfleet_worker_step_measured_time_seconds_total", MODEL_LABEL),
                 "steps": ("kvfleet_worker_steps_total", MODEL_LABEL),
                 "nested_steps": ("kvfleet_worker_nested_steps_total", MODEL_LABEL)}


def replica_counters(cluster) -> dict[str, float]:
    """The replicas' cumulative counters the phases are judged and explained by, summed over
    replicas: ``class:<priority class>`` (forward seconds charged to the class's rows),
    ``forward_s`` (forward seconds measured), ``steps`` and ``nested_steps`` (forwards run,
    and those run inside a paused one). Raises RuntimeError when a replica does not answer."""
    texts = replica_metric_texts(cluster, strict=True)
    out = {f"class:{k}": v for k, v in counter_by_label(
        texts, "kvfleet_worker_replica_time_seconds_total", CLASS_LABEL).items()}
    for key, (metric, label) in STEP_COUNTERS.items():
        out[key] = sum(counter_by_label(texts, metric, label).values())
    return out


async def counter_rates(scrape, start: float, seconds: float) -> dict[str, float]:
    """Each counter's growth a second over the middle half of a phase that began at ``start``
    (monotonic) and lasts ``seconds``: ``scrape()`` (blocking: name → cumulative value, e.g.
    :func:`replica_counters`) read at the half's two edges, the difference over the time
    between the reads (a counter first seen at the second read grew from 0)."""
    reads = []
    for edge in (start + seconds / 4, start + 3 * seconds / 4):
        await asyncio.sleep(max(0.0, edge - time.monotonic()))
        reads.append((time.monotonic(), await asyncio.to_thread(scrape)))
    (t0, c0), (t1, c1) = reads
    return {k: (v - c0.get(k, 0.0)) / (t1 - t0) for k, v in c1.items()}


async def streams(stub, run: Run, seconds: float,
                  spec: dict[str, tuple[float, str, str]], seed: int = 0, scrape=None) -> dict:
    """Poisson arrivals for ``seconds``; ``spec``: stream name → (rate /s, api key, class);
    ``seed`` picks the arrivals and prompts; ``scrape``: see :func:`counter_rates` (None: not
    read). Returns per stream: ``summarize``'s fields plus completions/s, the completions'
    replica-seconds per second of the phase and their mean replica-seconds (None: no
    completion), and ``class_replica_s_per_s``: what the replicas spent on the stream's class
    in the phase's middle half by their own counters (streams of one class share it); and
    under ``"replicas"`` every scraped counter's rate over that half."""
    rng = random.Random(5 + 1000 * seed)
    arrivals = []
    for name, (rate, key, klass) in spec.items():
        t = 0.0
        while rate > 0 and (t := t + rng.expovariate(rate)) < seconds:
            arrivals.append((t, name, key, klass))
    arrivals.sort()
    start, tasks = time.monotonic(), []
    rates = asyncio.create_task(counter_rates(scrape, start, seconds)) if scrape else None
    for t, name, key, klass in arrivals:
        delay = start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(stub, run, rng, name, key, priority=klass)))
    outs = list(await asyncio.gather(*tasks))
    counted = await rates if rates is not None else {}
    lo, hi = start + seconds / 4, start + 3 * seconds / 4
    result = {}
    for name in spec:
        mine = [o for o in outs if o.tenant == name]
        s = summarize(mine)
        s["completions_per_s"] = sum(1 for o in mine if o.code == "OK") / seconds
        spent = [o.replica_s or 0.0 for o in mine if o.code == "OK"]
        s["replica_s_per_s"] = sum(spent) / seconds
        s["replica_s_mean"] = sum(spent) / len(spent) if spent else None
        # the work the replicas did for this stream while the phase ran: what finished in its
        # middle half (an admitted flood's backlog drains after the phase and is not counted)
        inside = [o for o in mine if o.code == "OK" and lo <= o.end <= hi]
        s["window_completions_per_s"] = len(inside) / (hi - lo)
        s["window_replica_s_per_s"] = sum(o.replica_s or 0.0 for o in inside) / (hi - lo)
        if rates is not None:
            s["class_replica_s_per_s"] = counted.get(f"class:{spec[name][2]}", 0.0)
        result[name] = s
    if rates is not None:
        result["replicas"] = counted
    return result


async def wait_registered(stub, n: int, timeout_s: float = 60.0) -> None:
    """Until the router sees ``n`` replicas (as cluster admin ``chat``)."""
    md = (("authorization", "Bearer key-chat"),)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), metadata=md)
        if len(status.replicas) == n:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{n} replicas did not register")


async def drive(a: argparse.Namespace, run: Run, cluster) -> dict:
    scrape = lambda: replica_counters(cluster)  # noqa: E731
    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        await wait_registered(stub, run.replicas)
        await send(stub, run, random.Random(0), key="key-chat")  # warm-up
        cap = await capacity(stub, run, a.capacity_s, "key-chat")
        print(f"capacity {cap:.1f} req/s", flush=True)
        chat = (a.interactive_share * cap, "key-chat", "interactive")
        flood = (a.factor * cap, "key-batch", "batch")
        phases = {"interactive_alone": {"chat": chat}, "batch_alone": {"flood": flood},
                  "both": {"chat": chat, "flood": flood},
                  "both_unclassed": {"chat": (*chat[:2], "default"),
                                     "flood": (flood[0], "key-batch-default", "default")}}
        out: dict = {"capacity_per_s": cap}
        for name, spec in phases.items():
            out[name] = await streams(stub, run, a.duration_s, spec, a.seed, scrape)
            print(f"{name}: " + ", ".join(
                f"{s}: ttft p99 {r.get('ttft_p99_ms', float('nan')):.1f} ms, "
                f"{r['completions_per_s']:.1f}/s" for s, r in out[name].items() if s in spec),
                flush=True)
            await asyncio.sleep(2.0)  # the fleet drains
    return out


def targets(r: dict) -> dict:
    """The issue's two targets, from one run's phases: the TTFT ratio, and the batch side in
    replica-seconds (``throughput_target_met``: ``batch_drop_replica_s_per_s`` — what the
    replicas spent on class batch a second in ``batch_alone``'s middle half less in ``both``'s,
    by their own per-class counters — ≤ ``interactive_replica_s_per_s``, what they spent on
    class interactive in ``both``'s). Beside it, not judged: the same from the requests that
    *finished* in the middle half at their whole ``replica_s`` (``window_replica_s_ratio``: a
    sample of completions in waves, noisier than the counters), and in admitted completions
    (``completions_ratio``: with the flood every admitted request completes, so it counts what
    the router admitted, not what the replicas did)."""
    alone, both = r["interactive_alone"]["chat"], r["both"]["chat"]
    ratio = both["ttft_p99_ms"] / alone["ttft_p99_ms"]
    batch_alone, batch_both = r["batch_alone"]["flood"], r["both"]["flood"]
    batch_drop = batch_alone["completions_per_s"] - batch_both["completions_per_s"]
    drop_rs = batch_alone["class_replica_s_per_s"] - batch_both["class_replica_s_per_s"]
    used_rs = both["class_replica_s_per_s"]
    window_drop = batch_alone["window_replica_s_per_s"] - batch_both["window_replica_s_per_s"]
    window_used = both["window_replica_s_per_s"]
    return {"interactive_ttft_p99_ratio": ratio, "ttft_target_met": ratio <= 1.5,
            "unclassed_ttft_p99_ratio": r["both_unclassed"]["chat"]["ttft_p99_ms"]
            / alone["ttft_p99_ms"],
            "batch_drop_per_s": batch_drop, "interactive_per_s": both["completions_per_s"],
            "completions_ratio": batch_drop / both["completions_per_s"]
            if both["completions_per_s"] > 0 else None,
            "batch_drop_replica_s_per_s": drop_rs, "interactive_replica_s_per_s": used_rs,
            "replica_s_ratio": drop_rs / used_rs if used_rs > 0 else None,
            "window_replica_s_ratio": window_drop / window_used if window_used > 0 else None,
            "throughput_target_met": used_rs > 0 and drop_rs <= used_rs,
            # where a loss went: the replicas' forward seconds, forwards and nested forwards a
            # second over each phase's middle half (summed over replicas)
            "replicas_per_s": {phase: r[phase]["replicas"] for phase in
                               ("interactive_alone", "batch_alone", "both", "both_unclassed")
                               if "replicas" in r[phase]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.priority", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--factor", type=float, default=10.0, help="batch rate × capacity")
    p.add_argument("--interactive-share", type=float, default=0.1,
                   help="interactive rate as a fraction of capacity")
    p.add_argument("--duration-s", type=float, default=12.0, help="seconds per phase")
    p.add_argument("--capacity-s", type=float, default=6.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--scale", type=float, default=0.05, help="cost-model step times × scale")
    p.add_argument("--batch-share", type=float, default=1.0, help="replicas' --batch-share")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="replicas' --itl-target-ms (in the scaled cost model's milliseconds)")
    p.add_argument("--layer-yield", choices=("auto", "on", "off"), default="auto",
                   help="replicas' --layer-yield (default auto, the replicas' own: on here, "
                        "with two classes); off: atomic steps, for the A/B")
    p.add_argument("--seed", type=int, default=0, help="arrivals and prompts")
    p.add_argument("--tag", default="")
    p.add_argument("--router-arg", action="append", default=[], dest="router_args")
    a = p.parse_args(argv)
    run = Run(replicas=a.replicas, scale=a.scale, router_args=tuple(a.router_args),
              scheduler={"batch_share": a.batch_share,
                         "itl_target_ms": a.itl_target_ms,
                         "layer_yield": a.layer_yield})
    RESULTS.mkdir(parents=True, exist_ok=True)
    keys_file = RESULTS / "priority-keys.json"
    keys_file.write_text(json.dumps({"keys": KEYS, "admins": ["chat"]}))
    load_before = os.getloadavg()
    with local_cluster(run, str(keys_file)) as cluster:
        result = asyncio.run(drive(a, run, cluster))
        result["router_peak_rss_bytes"] = ProcStats(cluster.router_proc.pid).peak_rss_bytes()
    result["targets"] = targets(result)
    record = {"args": vars(a), "run": asdict(run), **result,
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()}}
    path = RESULTS / f"priority{'-' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
