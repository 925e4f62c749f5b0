"""Overload: how fast is a request the fleet cannot take refused, and what else ends how?

    .venv/bin/python -m bench.cluster.overload burst --requests 1500      # one simultaneous burst
    .venv/bin/python -m bench.cluster.overload burst --fill               # the same into a full fleet
    .venv/bin/python -m bench.cluster.overload open --factor 10 --duration-s 30   # open loop, 10x capacity
    .venv/bin/python -m bench.cluster.overload fair --tenant-share 0.5    # tenant flood vs a steady one

A local cluster of cost-model replicas (real router process, real scheduler, block pool,
Redis, gRPC; only the forward is a modelled sleep) is started once. ``burst`` sends every
request at the same instant; ``open`` first measures the fleet's capacity in a closed loop
(``replicas × max_num_seqs`` clients), then sends Poisson arrivals at ``factor ×`` that rate.
``burst --fill`` first fills every replica to its limit with long requests, so every request
of the burst is refused: the router's CPU per refused request. ``fair``: tenant ``steady``
alone at ``--steady-share`` of capacity (its unloaded TTFT), then the same stream while
tenant ``flood`` sends ``factor ×`` capacity (key file with ``default_tenant_share`` =
``--tenant-share``, replicas with ``tenant_share`` = ``--seat-share``, default the same);
then ``backlogged``: both tenants in closed loops that each could fill the fleet alone,
flood's prompts ``--flood-prompt-factor ×`` longer, and each tenant's share of the tokens the
replicas computed (uncached prompt + output, from the final messages' usage) and of the
weighted service (prompt × 1 + output × 2, the scheduler's fairness counter) over the middle
half of the phase: with two backlogged tenants the fair share is 1/2.
Reported: requests by final status, refusal (RESOURCE_EXHAUSTED) latency p50/p99 from the
client's send, TTFT p50/p99 of the admitted (and the worker's own queue and TTFT quantiles:
the rest of the client's TTFT is router, client and network), the router's CPU per request over the phase, and
the peak RSS (VmHWM) of the router and replica processes. JSON goes to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import grpc

from bench.common.report import quantile
from bench.common.result_file import RESULTS
from kvfleet.grpc_util import CHANNEL_OPTIONS
from kvfleet.v1 import router_pb2, router_pb2_grpc


@dataclass
class Outcome:
    """One request as the client saw it; times are ``time.monotonic()`` seconds."""

    tenant: str
    sent: float
    end: float = 0.0
    first: Optional[float] = None
    code: str = "OK"
    details: str = ""
    worker_queue_s: Optional[float] = None  # the worker's own timing (final message)
    worker_ttft_s: Optional[float] = None
    replica_s: Optional[float] = None  # the replica's forward seconds its rows took (worker's)
    computed_tokens: int = 0  # uncached prompt + output tokens the worker computed
    service: float = 0.0      # the same, weighted as the scheduler's fairness counts them
    replica: str = ""         # the replica that answered (final message)


@dataclass(frozen=True)
class Run:
    replicas: int = 2
    scale: float = 0.05          # cost-model step times × scale
    num_blocks: int = 640
    max_num_seqs: int = 16
    prompt_tokens: int = 64
    max_tokens: int = 16
    router_args: tuple[str, ...] = ()
    api_keys: dict = field(default_factory=dict)  # key -> tenant (empty: open router)
    tenant_share: float = 1.0  # replicas' SchedulerConfig.tenant_share (--seat-share)
    scheduler: dict = field(default_factory=dict)  # more SchedulerConfig fields (bench.priority)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def send(stub, run: Run, rng: random.Random, tenant: str = "",
               key: Optional[str] = None, timeout_s: float = 120.0,
               max_tokens: Optional[int] = None, prompt_tokens: Optional[int] = None,
               priority: str = "") -> Outcome:
    """One ``Router.Generate`` of a fresh random prompt (``priority``: its class, "" = the
    key's default); never raises."""
    from kvfleet.router.tenant_limits import request_service

    req = router_pb2.GenerateRequest()
    if priority:
        req.priority_class = priority
    req.token_ids.ids.extend(_prompt(rng, prompt_tokens or run.prompt_tokens))
    req.sampling.max_tokens = max_tokens or run.max_tokens
    req.sampling.ignore_eos = True
    md = (("authorization", f"Bearer {key}"),) if key else None
    out = Outcome(tenant, time.monotonic())
    try:
        async for m in stub.Generate(req, metadata=md, timeout=timeout_s):
            if out.first is None and m.token_ids:
                out.first = time.monotonic()
            if m.finish_reason:
                out.worker_queue_s, out.worker_ttft_s = m.timing.queue_s, m.timing.ttft_s
                out.replica_s = m.timing.replica_s
                out.replica = m.replica_id
                u = m.usage
                out.computed_tokens = (u.prompt_tokens - u.cached_prompt_tokens
                                       + u.completion_tokens)
                out.service = request_service(u.prompt_tokens, u.cached_prompt_tokens,
                                              u.completion_tokens)
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
    out.end = time.monotonic()
    return out


def slowest_split(outs: list[Outcome], n: int = 8) -> list[dict]:
    """The ``n`` admitted requests with the longest client TTFT, each split (milliseconds) into the
    worker's queue (arrival to first scheduled: a seat wait), its prefill (first scheduled to first
    token: step lengths) and the rest outside the worker (router, network, stream relay); with
    its replica and ``own_open``, how many of ``outs`` were open on that replica when it was
    sent (the same tenant's when ``outs`` is one tenant's)."""
    done = [o for o in outs if o.code == "OK" and o.first and o.worker_ttft_s is not None]
    done.sort(key=lambda o: o.first - o.sent, reverse=True)  # type: ignore[operator]
    rows, opened = [], open_by_request(outs)
    for o in done[:n]:
        ttft = (o.first - o.sent) * 1e3  # type: ignore[operator]
        queue, wttft = (o.worker_queue_s or 0.0) * 1e3, (o.worker_ttft_s or 0.0) * 1e3
        own = opened.get(id(o), 0)
        rows.append({"ttft_ms": round(ttft, 2), "queue_ms": round(queue, 2),
                     "prefill_ms": round(wttft - queue, 2), "outside_ms": round(ttft - wttft, 2),
                     "replica": o.replica, "own_open": own})
    return rows


def open_by_request(outs: list[Outcome]) -> dict[int, int]:
    """``id(o)`` → how many admitted requests of ``outs`` were open on ``o``'s replica when
    ``o`` was sent (sent before, ended after), for every admitted ``o``: one sweep per replica."""
    by_replica: dict[str, list[Outcome]] = {}
    for o in outs:
        if o.code == "OK" and o.replica:
            by_replica.setdefault(o.replica, []).append(o)
    counts = {}
    for group in by_replica.values():
        sent, ended = sorted(p.sent for p in group), sorted(p.end for p in group)
        for o in group:
            counts[id(o)] = bisect.bisect_left(sent, o.sent) - bisect.bisect_right(ended, o.sent)
    return counts


def open_at_send(outs: list[Outcome], o: Outcome) -> int:
    """:func:`open_by_request` for one request (0 for one not admitted)."""
    return open_by_request(outs).get(id(o), 0)


def open_counts(outs: list[Outcome]) -> list[int]:
    """:func:`open_by_request`'s counts, for every admitted request of ``outs``."""
    return list(open_by_request(outs).values())


def summarize(outs: list[Outcome]) -> dict:
    """Counts by status, refusal latency and admitted TTFT quantiles (milliseconds)."""
    codes = Counter(o.code for o in outs)
    refused = [(o.end - o.sent) * 1e3 for o in outs if o.code == "RESOURCE_EXHAUSTED"]
    ttft = [(o.first - o.sent) * 1e3 for o in outs if o.code == "OK" and o.first]
    s: dict = {"requests": len(outs), "by_status": dict(codes)}
    if refused:
        s.update(refusal_p50_ms=quantile(refused, 0.5), refusal_p99_ms=quantile(refused, 0.99),
                 refusal_max_ms=max(refused))
    if ttft:
        s.update(ttft_p50_ms=quantile(ttft, 0.5), ttft_p99_ms=quantile(ttft, 0.99))
    # Where TTFT goes: the worker's share (queue, then queue + prefill) of it.
    for name in ("worker_queue_s", "worker_ttft_s"):
        xs = [getattr(o, name) * 1e3 for o in outs if o.code == "OK" and getattr(o, name) is not None]
        if xs:
            s[f"{name[:-2]}_p50_ms"], s[f"{name[:-2]}_p99_ms"] = quantile(xs, 0.5), quantile(xs, 0.99)
    s["slowest"] = slowest_split(outs)
    s["by_replica"] = dict(sorted(Counter(o.replica for o in outs if o.code == "OK").items()))
    opened = open_counts(outs)  # one tenant's outs: its own requests open where each landed
    if opened:
        s["open_at_send"] = {"p50": quantile(opened, 0.5), "p99": quantile(opened, 0.99),
                             "max": max(opened)}
    other = sorted({f"{o.code}: {o.details}" for o in outs
                    if o.code not in ("OK", "RESOURCE_EXHAUSTED")})
    s["other_statuses"] = other[:5]
    s["refusal_messages"] = sorted({o.details for o in outs
                                    if o.code == "RESOURCE_EXHAUSTED"})[:3]
    return s


class ProcStats:
    """CPU seconds and peak RSS of a process, from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


async def burst(stub, run: Run, n: int, router: ProcStats, fill: bool = False) -> dict:
    """``n`` requests at once (into a fleet filled to its limits first, with ``fill``)."""
    rng = random.Random(1)
    fillers: list[asyncio.Task] = []
    if fill:  # long requests until the fleet refuses: every replica at its limit
        while not any(t.done() and t.result().code == "RESOURCE_EXHAUSTED" for t in fillers):
            fillers.append(asyncio.create_task(send(stub, run, rng, max_tokens=400)))
            await asyncio.sleep(0.002)
        await asyncio.sleep(1.0)
    cpu0 = router.cpu_s()
    outs = await asyncio.gather(*(send(stub, run, rng) for _ in range(n)))
    s = summarize(list(outs))
    s["router_cpu_per_request_ms"] = (router.cpu_s() - cpu0) / n * 1e3
    for t in fillers:
        t.cancel()
    await asyncio.gather(*fillers, return_exceptions=True)
    return s


async def capacity(stub, run: Run, seconds: float, key: Optional[str] = None) -> float:
    """Completions per second with ``replicas × max_num_seqs`` closed-loop clients."""
    rng = random.Random(2)
    stop_at = time.monotonic() + seconds
    done: list[Outcome] = []

    async def client() -> None:
        while time.monotonic() < stop_at:
            done.append(await send(stub, run, rng, key=key))

    await asyncio.gather(*(client() for _ in range(run.replicas * run.max_num_seqs)))
    ok = [o for o in done if o.code == "OK" and o.end >= stop_at - seconds / 2]
    return len(ok) / (seconds / 2)


async def open_loop(stub, run: Run, rate: float, seconds: float, router: ProcStats,
                    tenants: Optional[dict[str, tuple[float, Optional[str]]]] = None,
                    seed: int = 0) -> dict:
    """Poisson arrivals for ``seconds``; ``tenants``: name → (rate, api key) instead of one
    anonymous stream at ``rate``; ``seed`` picks the arrivals and prompts."""
    rng = random.Random(3 + 1000 * seed)
    streams = tenants or {"": (rate, None)}
    arrivals = []
    for name, (r, key) in streams.items():
        t = 0.0
        while (t := t + rng.expovariate(r)) < seconds:
            arrivals.append((t, name, key))
    arrivals.sort()
    cpu0, start, tasks = router.cpu_s(), time.monotonic(), []
    for t, name, key in arrivals:
        delay = start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(stub, run, rng, name, key)))
    outs = list(await asyncio.gather(*tasks))
    s = summarize(outs)
    s["router_cpu_per_request_ms"] = (router.cpu_s() - cpu0) / max(1, len(outs)) * 1e3
    s["offered_rate_per_s"] = len(arrivals) / seconds
    if tenants:
        s["per_tenant"] = {name: summarize([o for o in outs if o.tenant == name])
                           for name in tenants}
    return s


async def backlogged(stub, run: Run, seconds: float, clients: int,
                     tenants: dict[str, tuple[str, int]]) -> dict:
    """Every tenant (name → (api key, prompt tokens)) in ``clients`` closed-loop clients for
    ``seconds`` (a refusal is retried after 20 ms): each tenant's share of computed tokens
    and of weighted service among the requests that finished in the middle half."""
    rng = random.Random(4)
    start = time.monotonic()
    stop_at = start + seconds
    done: list[Outcome] = []

    async def client(name: str, key: str, prompt_tokens: int) -> None:
        while time.monotonic() < stop_at:
            out = await send(stub, run, rng, name, key, prompt_tokens=prompt_tokens)
            done.append(out)
            if out.code != "OK":
                await asyncio.sleep(0.02)

    await asyncio.gather(*(client(name, key, n) for name, (key, n) in tenants.items()
                           for _ in range(clients)))
    window = [o for o in done if o.code == "OK"
              and start + seconds / 4 <= o.end <= start + 3 * seconds / 4]
    tokens = {t: sum(o.computed_tokens for o in window if o.tenant == t) for t in tenants}
    service = {t: sum(o.service for o in window if o.tenant == t) for t in tenants}
    return {"prompt_tokens": {t: n for t, (_, n) in tenants.items()},
            "by_status": dict(Counter(f"{o.tenant}:{o.code}" for o in done)),
            "computed_tokens": tokens, "service": service,
            "computed_share": {t: v / max(1, sum(tokens.values())) for t, v in tokens.items()},
            "service_share": {t: v / max(1e-9, sum(service.values())) for t, v in service.items()},
            "fair_share": 1 / len(tenants)}


def start_cluster(run: Run, redis_url: str, api_keys_file: Optional[str]):
    from dataclasses import replace

    from kvfleet.deploy.cluster_config import ClusterConfig, router_from_flags
    from kvfleet.deploy.launcher import LocalCluster
    from kvfleet.deploy.models import DEFAULT_MODEL, resolve_model
    from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
    from kvfleet.worker.executor.cost_model import MEASURED
    from kvfleet.worker.replica.replica import ReplicaConfig

    name, model_dir = resolve_model(DEFAULT_MODEL)
    replica = ReplicaConfig(
        name, name, str(model_dir), block_size=16, num_blocks=run.num_blocks,
        redis_url=redis_url, namespace="bench-overload:",
        scheduler=SchedulerConfig(max_num_seqs=run.max_num_seqs, max_num_batched_tokens=512,
                                  # only when set: a checkout before tenant shares runs too (A/B)
                                  **({"tenant_share": run.tenant_share}
                                     if run.tenant_share != 1.0 else {}), **run.scheduler),
        executor="cost-model", cost_model=MEASURED.scaled(run.scale))
    router = replace(router_from_flags(run.router_args), port=0, api_keys_file=api_keys_file)
    # Prometheus on each replica (a free port): the preemption counters by reason
    cfg = ClusterConfig(replica, router, replicas=run.replicas, replica_num_cpus=0, metrics_port=0)
    cluster = LocalCluster(cfg)
    cluster.start()
    return cluster


@contextlib.contextmanager
def local_cluster(run: Run, api_keys_file: Optional[str]):
    """A private Redis, a local Ray and :func:`start_cluster`'s cluster, stopped on exit."""
    from kvfleet.deploy.ray_local import init_ray, shutdown_ray
    from kvfleet.deploy.redis_server import start_redis

    redis = start_redis()
    init_ray(num_cpus=2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster = None
    try:
        cluster = start_cluster(run, redis.url, api_keys_file)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        redis.stop()
        shutdown_ray()


def replica_metric_texts(cluster, strict: bool = False) -> list[str]:
    """Each replica's Prometheus exposition text. A replica that does not answer is left out,
    or with ``strict`` raises RuntimeError naming it (a rate from two reads must not mix a
    missing replica's read with a present one)."""
    import urllib.request

    texts = []
    for name, address in cluster.metrics_addresses.items():
        if not name.startswith("replica-"):
            continue
        try:
            if not address:
                raise OSError("no metrics address")
            texts.append(urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode())
        except OSError as exc:
            if strict:
                raise RuntimeError(f"{name}: its metrics could not be read ({exc})") from exc
    return texts


def counter_by_label(texts: list[str], metric: str, label: str) -> dict[str, float]:
    """``metric`` (its full exposition name) in the exposition ``texts``, summed by the value
    of its ``label``; {} where no text has it."""
    counts: Counter = Counter()
    for text in texts:
        for line in text.splitlines():
            if line.startswith(metric + "{") and f'{label}="' in line:
                value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                counts[value] += float(line.rsplit(" ", 1)[1])
    return dict(counts)


def replica_counter(cluster, metric: str, label: str) -> dict[str, float]:
    """A counter the replicas export, summed over replicas by the value of its ``label``."""
    return counter_by_label(replica_metric_texts(cluster), metric, label)


def preemptions(cluster) -> dict[str, float]:
    """The replicas' preemptions by reason, summed (``kvfleet_worker_preemptions_total``)."""
    return replica_counter(cluster, "kvfleet_worker_preemptions_total", "reason")


def actor_pids(cluster) -> list[int]:
    return cluster.replica_pids()


async def drive(a: argparse.Namespace, run: Run, cluster) -> dict:
    from bench.cluster.router_bench import wait_registered

    admin = "key-admin" if run.api_keys else None  # ClusterStatus is for admins only
    await wait_registered(cluster.router_address, run.replicas, key=admin)
    router = ProcStats(cluster.router_proc.pid)
    async with grpc.aio.insecure_channel(cluster.router_address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        await send(stub, run, random.Random(0))  # warm-up
        if a.cmd == "burst":
            return await burst(stub, run, a.requests, router, a.fill)
        key = "key-flood" if a.cmd == "fair" else None
        cap = await capacity(stub, run, a.capacity_s, key)
        print(f"capacity {cap:.1f} req/s", flush=True)
        if a.cmd == "open":
            s = await open_loop(stub, run, a.factor * cap, a.duration_s, router)
            s["capacity_per_s"] = cap
            return s
        steady = {"steady": (a.steady_share * cap, "key-steady")}
        alone = await open_loop(stub, run, 0, a.duration_s, router, steady, a.seed)
        await asyncio.sleep(2.0)  # the fleet drains
        pre0 = preemptions(cluster)
        both = await open_loop(stub, run, 0, a.duration_s, router,
                               {"flood": (a.factor * cap, "key-flood"), **steady}, a.seed)
        # what the flood phase preempted, by reason: a seat for B, memory, a class
        both["preemptions"] = {k: v - pre0.get(k, 0.0) for k, v in preemptions(cluster).items()}
        alone_p99 = alone["per_tenant"]["steady"].get("ttft_p99_ms")
        both_p99 = both["per_tenant"]["steady"].get("ttft_p99_ms")
        ratio = both_p99 / alone_p99 if alone_p99 and both_p99 else None
        if a.no_backlogged:
            return {"capacity_per_s": cap, "steady_alone": alone["per_tenant"]["steady"],
                    "with_flood": both, "steady_ttft_p99_ratio": ratio}
        await asyncio.sleep(2.0)
        flood_prompt = int(run.prompt_tokens * a.flood_prompt_factor)
        shares = await backlogged(stub, run, a.duration_s, run.replicas * run.max_num_seqs,
                                  {"flood": ("key-flood", flood_prompt),
                                   "steady": ("key-steady", run.prompt_tokens)})
        return {"capacity_per_s": cap, "steady_alone": alone["per_tenant"]["steady"],
                "with_flood": both, "backlogged": shares, "steady_ttft_p99_ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("burst", help="N requests at the same instant")
    b.add_argument("--requests", type=int, default=1500)
    b.add_argument("--fill", action="store_true",
                   help="fill every replica to its limit first: every burst request is refused")
    o = sub.add_parser("open", help="open-loop Poisson arrivals at factor × capacity")
    f = sub.add_parser("fair", help="tenant 'flood' at factor × capacity, 'steady' within its share")
    f.add_argument("--steady-share", type=float, default=0.2,
                   help="tenant steady's rate as a fraction of capacity")
    f.add_argument("--tenant-share", type=float, default=0.5,
                   help="the key file's default_tenant_share (and, by default, --seat-share)")
    f.add_argument("--seat-share", type=float, default=None,
                   help="replicas' tenant_share: a tenant's share of running slots")
    f.add_argument("--flood-prompt-factor", type=float, default=4.0,
                   help="backlogged phase: flood's prompts are this many times steady's")
    f.add_argument("--no-backlogged", action="store_true",
                   help="stop after the flood phase (TTFT only, no shares)")
    f.add_argument("--seed", type=int, default=0, help="the open-loop arrivals and prompts")
    for q in (o, f):
        q.add_argument("--factor", type=float, default=10.0)
        q.add_argument("--duration-s", type=float, default=30.0)
        q.add_argument("--capacity-s", type=float, default=10.0)
    for q in (b, o, f):
        q.add_argument("--replicas", type=int, default=2)
        q.add_argument("--scale", type=float, default=0.05)
        q.add_argument("--max-tokens", type=int, default=Run.max_tokens)
        q.add_argument("--tag", default="")
        q.add_argument("--router-arg", action="append", default=[], dest="router_args")
        q.add_argument("--itl-target-ms", type=float, default=None,
                       help="replicas' --itl-target-ms (in the scaled cost model's milliseconds)")
    a = p.parse_args(argv)
    keys = ({"key-flood": "flood", "key-steady": "steady", "key-admin": "bench-admin"}
            if a.cmd == "fair" else {})
    share = a.tenant_share if a.cmd == "fair" else 1.0
    seats = a.seat_share if a.cmd == "fair" and a.seat_share is not None else share
    run = Run(replicas=a.replicas, scale=a.scale, max_tokens=a.max_tokens,
              router_args=tuple(a.router_args), api_keys=keys,
              tenant_share=seats,
              # only when set: a checkout before the ITL target runs too (A/B)
              scheduler={**({"itl_target_ms": a.itl_target_ms} if a.itl_target_ms else {})})
    RESULTS.mkdir(parents=True, exist_ok=True)
    keys_file = None
    if keys:
        keys_file = RESULTS / "overload-keys.json"
        keys_file.write_text(json.dumps({"keys": keys, "default_tenant_share": share,
                                         "admins": ["bench-admin"]}))
    load_before = os.getloadavg()
    with local_cluster(run, str(keys_file) if keys_file else None) as cluster:
        result = asyncio.run(drive(a, run, cluster))
        result["peak_rss_bytes"] = {
            "router": ProcStats(cluster.router_proc.pid).peak_rss_bytes(),
            "replica_hosts": [ProcStats(pid).peak_rss_bytes() for pid in actor_pids(cluster)]}
    record = {"cmd": a.cmd, "args": vars(a), "run": asdict(run), **result,
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()}}
    path = RESULTS / f"overload-{a.cmd}{'-' + a.tag if a.tag else ''}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
