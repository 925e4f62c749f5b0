"""What the router itself costs, against a cost-model replica that answers at once.

    .venv/bin/python -m bench.cluster.router_cost

1. Added TTFT: the same Poisson stream (``--rates`` req/s, 1,024-token shared prefix + 64
   unique tokens, one output token) sent straight to the worker, through the router (which
   looks prefixes up in its in-memory mirror of the index), through a second router run with
   ``--no-index-mirror`` (one Redis round trip per request) and through :mod:`bench.cluster.null_relay`
   (a do-nothing Python gRPC relay: the floor of any hop written like the router, on this
   machine), in rotating segments; added TTFT = relayed quantile − direct quantile.
2. Prefix lookup: ``RedisPrefixIndex.match`` latency for 256-, 1,024- and 4,096-token chains
   that four replicas hold in full, Redis commands per lookup (``INFO commandstats``), and the
   same lookups answered by ``MirroredPrefixIndex`` from memory.
3. Index writes off the TTFT path: direct TTFT with Redis answering vs Redis frozen (SIGSTOP):
   if a KV-event write sat on the path, every TTFT would grow by the write timeout.
4. Relay: streamed messages/s of long generations straight from the worker vs through the
   router, and the router process's CPU µs per relayed message (``/proc``).
5. Decisions: CPU µs of one ``policy.choose`` per policy and prompt size, in-process
   (:mod:`bench.cluster.decision_cost`, its defaults); ``--decisions`` runs only this, without a fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.cluster import decision_cost
from bench.cluster.zero_fleet import ZeroFleet, zero_fleet
from bench.common.load import Target, open_loop
from bench.common.report import quantile
from bench.common.result_file import ROOT, write_json
from bench.common.workload import Request, Workload, requests


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def q_ms(xs, q: float) -> float:
    return quantile(xs, q) * 1e3


async def added_ttft(worker: Target, relays: dict[str, Target], rate: float, segment: int,
                     rounds: int) -> dict:
    """Added TTFT of each relay over ``worker``: segments rotate so that drift hits all alike."""
    w = Workload(groups=1, prefix_tokens=1024, suffix_tokens=64)
    order = [("direct", worker), *relays.items()]
    ttft: dict[str, list[float]] = {name: [] for name, _ in order}
    for r in range(rounds):
        reqs = requests(w, rate, segment, seed=50 + r)
        for name, target in order[r % len(order):] + order[:r % len(order)]:
            res = await open_loop(target, reqs)
            ttft[name] += [x.ttft_s for x in res if x.ok]
            await asyncio.sleep(0.5)
    got = {"rate_per_s": rate, "requests_each": len(ttft["direct"])}
    for q in (0.5, 0.9, 0.99):
        p = f"p{int(q * 100)}"
        got[f"direct_{p}_ms"] = q_ms(ttft["direct"], q)
        for name in relays:
            got[f"{name}_{p}_ms"] = q_ms(ttft[name], q)
            got[f"{name}_added_{p}_ms"] = got[f"{name}_{p}_ms"] - got[f"direct_{p}_ms"]
    return got


async def lookup_latency(redis_url: str, calls: int = 400) -> dict:
    import redis.asyncio as aioredis

    from kvfleet.allocator.hashing import block_hash_chain
    from kvfleet.index_keys import ReplicaInfo
    from kvfleet.router.index_mirror import MirroredPrefixIndex
    from kvfleet.router.prefix_index import RedisPrefixIndex
    from kvfleet.worker.replica.kv_publisher import KvPublisher

    ns = "bench-lookup:"
    chain = block_hash_chain(b"r" * 16, list(range(1000, 1000 + 4096)), 16)
    pubs = [KvPublisher(redis_url, ReplicaInfo(f"r{i}", f"127.0.0.1:{i}", "m", 0, 16), ns)
            for i in range(4)]
    for p in pubs:
        await p.register()
        await p.publish(chain, [])
    index = RedisPrefixIndex(redis_url, namespace=ns)
    mirror = MirroredPrefixIndex(RedisPrefixIndex(redis_url, namespace=ns), redis_url, ns)
    mirror.start()
    await mirror.sync()
    await mirror.replicas()
    raw = aioredis.Redis.from_url(redis_url)
    out = {}

    async def timed(ix, sub) -> list[float]:
        lat = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await ix.match(sub)
            lat.append(time.perf_counter() - t0)
        return lat

    for tokens in (256, 1024, 4096):
        sub = chain[: tokens // 16]
        want = {f"r{i}": len(sub) for i in range(4)}
        assert await index.match(sub) == want and await mirror.match(sub) == want
        await raw.config_resetstat()
        lat = await timed(index, sub)
        stats = await raw.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {})
        assert mirror.local
        mirrored = await timed(mirror, sub)
        out[f"{tokens}_tokens"] = {
            "p50_ms": q_ms(lat, 0.5), "p99_ms": q_ms(lat, 0.99),
            "redis_commands_per_lookup": sum(v["calls"] for v in stats.values()) / calls,
            "script_calls_per_lookup": evalsha.get("calls", 0) / calls,
            "redis_side_us_per_lookup": evalsha.get("usec_per_call", 0.0),
            "mirror_p50_ms": q_ms(mirrored, 0.5), "mirror_p99_ms": q_ms(mirrored, 0.99)}
    await mirror.close()
    for p in pubs:
        await p.deregister()
        await p.close()
    await index.close()
    await raw.aclose()
    return out


async def writes_off_path(worker: Target, redis_process, rate: float, n: int) -> dict:
    w = Workload(groups=1, prefix_tokens=1024, suffix_tokens=64)
    out = {}
    for state in ("redis_answering", "redis_frozen"):
        if state == "redis_frozen":
            redis_process.send_signal(signal.SIGSTOP)
        try:
            res = await open_loop(worker, requests(w, rate, n, seed=90))
        finally:
            if state == "redis_frozen":
                redis_process.send_signal(signal.SIGCONT)
        ttft = [x.ttft_s for x in res if x.ok]
        out[state] = {"ttft_p50_ms": q_ms(ttft, 0.5), "ttft_p99_ms": q_ms(ttft, 0.99),
                      "ok": len(ttft), "requests": n}
    return out


async def relay(worker: Target, router: Target, router_pid: int, streams: int, seconds: float,
                rounds: int) -> dict:
    req = Request(0, 0, tuple(range(1000, 1016)), 0.0)
    out = {"direct_msgs_per_s": [], "routed_msgs_per_s": [], "router_cpu_us_per_msg": []}

    async def phase(target: Target, key: str) -> None:
        stop, count = time.monotonic() + seconds, 0

        async def client() -> None:
            nonlocal count
            while time.monotonic() < stop:
                res = await target.send(req)
                count += res.messages
        cpu0, t0 = cpu_seconds(router_pid), time.monotonic()
        await asyncio.gather(*(client() for _ in range(streams)))
        elapsed, cpu = time.monotonic() - t0, cpu_seconds(router_pid) - cpu0
        out[key].append(count / elapsed)
        if target is router:
            out["router_cpu_us_per_msg"].append(cpu / count * 1e6)

    for _ in range(rounds):
        await phase(worker, "direct_msgs_per_s")
        await phase(router, "routed_msgs_per_s")
    ratios = [r / d for r, d in zip(out["routed_msgs_per_s"], out["direct_msgs_per_s"])]
    return {**out, "routed_over_direct": ratios, "streams": streams,
            "tokens_per_stream": worker.max_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.router_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="30,100", help="requests/s for the TTFT test")
    p.add_argument("--segment", type=int, default=400)
    p.add_argument("--rounds", type=int, default=6, help="segments per target and rate")
    p.add_argument("--decisions", action="store_true",
                   help="only item 5, the policies' decision cost (bench.cluster.decision_cost)")
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    if a.decisions:
        out = {"decisions": decision_cost.main_defaults()}
    else:
        with zero_fleet("bench-cost:") as fleet:
            out = _measure(a, fleet)
        out["decisions"] = decision_cost.main_defaults()
    out["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg()}
    write_json("router-cost.json", out)
    return 0


def _measure(a: argparse.Namespace, fleet: ZeroFleet) -> dict:
    """The four measurements on a started fleet, beside a null relay and a second router
    that looks every prompt up in Redis (both stopped on the way out)."""
    from kvfleet.deploy.process_relay import wait_ready

    cluster, redis = fleet.cluster, fleet.redis
    relay_proc = redis_router = None
    try:
        relay_proc = subprocess.Popen(
            [sys.executable, "-m", "bench.cluster.null_relay", cluster.replica_addresses[0]],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        null_relay_address = wait_ready(relay_proc, "ready ", 60.0)
        # The same router looking every prompt up in Redis: the mirror's A/B in the same run.
        redis_router = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.router.main", "--redis-url", redis.url,
             "--model-name", fleet.name, "--model-dir", fleet.model_dir, "--port", "0",
             "--namespace", "bench-cost:", "--no-index-mirror"], stdout=subprocess.PIPE, text=True)
        redis_router_address = wait_ready(redis_router, "router ready ", 120.0)

        async def run() -> dict:
            from bench.cluster.router_bench import wait_registered

            await wait_registered(cluster.router_address, 1)
            await wait_registered(redis_router_address, 1)
            worker = Target(cluster.replica_addresses[0], kind="worker", max_tokens=1)
            router = Target(cluster.router_address, max_tokens=1)
            via_redis = Target(redis_router_address, max_tokens=1)
            null = Target(null_relay_address, max_tokens=1)
            pids = {"routed": cluster.router_proc.pid, "routed_redis_lookup": redis_router.pid,
                    "null_relay": relay_proc.pid}
            cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
            relays = {"routed": router, "routed_redis_lookup": via_redis, "null_relay": null}
            out = {"added_ttft": [await added_ttft(worker, relays, float(rate), a.segment,
                                                   a.rounds) for rate in a.rates.split(",")]}
            routed = sum(x["requests_each"] for x in out["added_ttft"])
            for k, pid in pids.items():  # each relay served as many requests as "direct"
                out[f"cpu_ms_per_request_{k}"] = (cpu_seconds(pid) - cpu0[k]) / routed * 1e3
            print(json.dumps(out), flush=True)
            out["prefix_lookup"] = await lookup_latency(redis.url)
            print(json.dumps(out["prefix_lookup"]), flush=True)
            out["index_writes"] = await writes_off_path(worker, redis.process, 50.0, 200)
            print(json.dumps(out["index_writes"]), flush=True)
            long_w = Target(cluster.replica_addresses[0], kind="worker", max_tokens=2000)
            long_r = Target(cluster.router_address, max_tokens=2000)
            out["relay"] = await relay(long_w, long_r, cluster.router_proc.pid, 8, 6.0, 3)
            print(json.dumps(out["relay"]), flush=True)
            for t in (worker, router, via_redis, null, long_w, long_r):
                await t.close()
            return out

        return asyncio.run(run())
    finally:
        for proc in (relay_proc, redis_router):
            if proc is not None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
