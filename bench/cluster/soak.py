"""Fault soak: mixed load with faults injected, then what leaked and how latency moved.

    .venv/bin/python -m bench.cluster.soak                 # ~10 minutes
    .venv/bin/python -m bench.cluster.soak --minutes 3

A private Redis, ``--replicas`` cost-model replicas (one process each; real scheduler, block
pool, KV events, gRPC) and the real router process. ``--clients`` closed-loop clients send a
mix of requests: normal ones (shared system prefixes), ones the client cancels mid-stream,
ones with short deadlines, bad inputs, and slow readers (a long stream nobody reads on a
small HTTP/2 window, which the router must cancel). Faults, at fixed fractions of the run: at
30 % one replica is SIGKILLed and restarted under the same id after ``--down-s``; at 60 %
Redis is stopped and a fresh, empty one started on the same port after ``--down-s``.

Reported (JSON in ``bench/results/soak.json``): requests by kind and final status; unexpected
statuses (outside what each kind may end with) inside and outside the fault windows; blocks
leaked (every replica's free blocks against its total once idle: must be 0); RSS of every
process at the start of the load and at the end; TTFT p50/p99 of normal requests in each
window: before, during and after each fault.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import grpc

from bench.cluster.soak_fleet import FleetSpec, SoakFleet, rss_bytes
from bench.common.report import quantile
from bench.common.result_file import RESULTS
from kvfleet.grpc_util import CHANNEL_OPTIONS
from kvfleet.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

KINDS = {"normal": 0.62, "cancel": 0.12, "deadline": 0.12, "bad": 0.08, "slow": 0.06}
# What each kind may end with; anything else is unexpected (a fault window may explain it).
EXPECTED = {"normal": {"OK"}, "cancel": {"CANCELLED_BY_CLIENT", "OK"},
            "deadline": {"OK", "DEADLINE_EXCEEDED"}, "slow": {"RESOURCE_EXHAUSTED"},
            "bad": {"INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND"}}
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
MAX_SLOW_READERS = 2  # at once


@dataclass
class Outcome:
    kind: str
    sent: float       # monotonic seconds since the load started
    end: float = 0.0
    ttft: Optional[float] = None
    code: str = "OK"


def _request(rng: random.Random, max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest()
    system = random.Random(rng.randrange(8))  # 8 shared 48-token prefixes
    req.token_ids.ids.extend([system.randrange(1000, 40000) for _ in range(48)]
                             + [rng.randrange(1000, 40000) for _ in range(16)])
    req.sampling.max_tokens, req.sampling.ignore_eos = max_tokens, True
    return req


def _bad_request(rng: random.Random) -> router_pb2.GenerateRequest:
    req = _request(rng, 8)
    which = rng.randrange(5)
    if which == 0:
        req.text = ""  # the oneof becomes an empty text prompt
    elif which == 1:
        req.token_ids.ids.append(10**8)
    elif which == 2:
        req.sampling.max_tokens = 10**6
    elif which == 3:
        req.sampling.temperature = float("nan")
    else:
        req.model = "no-such-model"
    return req


class Load:
    """The clients, the slow readers' channels and every outcome."""

    def __init__(self, address: str, stall_s: float, seed: int = 1) -> None:
        self.address, self.stall_s = address, stall_s
        self.rng = random.Random(seed)
        self.t0 = time.monotonic()
        self.outcomes: list[Outcome] = []
        self.slow_now = 0
        self.stopping = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def client(self, stub) -> None:
        while not self.stopping:
            kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            if kind == "slow" and self.slow_now >= MAX_SLOW_READERS:
                kind = "normal"
            out = Outcome(kind, self.now())
            try:
                await (self._slow(out) if kind == "slow" else self._one(stub, out))
            except grpc.aio.AioRpcError as exc:
                out.code = exc.code().name
            out.end = self.now()
            self.outcomes.append(out)
            await asyncio.sleep(self.rng.expovariate(20.0))

    async def _one(self, stub, out: Outcome) -> None:
        rng, timeout = self.rng, 60.0
        if out.kind == "bad":
            req = _bad_request(rng)
        else:
            req = _request(rng, {"normal": rng.randrange(8, 33), "deadline": 16}.get(out.kind, 64))
        if out.kind == "deadline":
            timeout = rng.uniform(0.05, 0.6)
        stop_after = rng.randrange(1, 6) if out.kind == "cancel" else None
        call = stub.Generate(req, timeout=timeout)
        seen = 0
        async for msg in call:
            if out.ttft is None and msg.token_ids:
                out.ttft = self.now() - out.sent
            seen += 1
            if stop_after is not None and seen >= stop_after:
                call.cancel()
                out.code = "CANCELLED_BY_CLIENT"
                return

    async def _slow(self, out: Outcome) -> None:
        """A 2,000-token stream nobody reads for 3 × the stall bound, then read to its end."""
        self.slow_now += 1
        try:
            async with grpc.aio.insecure_channel(self.address, options=SMALL_WINDOW) as ch:
                call = router_pb2_grpc.RouterStub(ch).Generate(_request(self.rng, 2000))
                await asyncio.sleep(3 * self.stall_s)
                async for _ in call:
                    pass
        finally:
            self.slow_now -= 1


def _window_stats(outs: list[Outcome], start: float, end: float) -> dict:
    ttft = [o.ttft * 1e3 for o in outs
            if o.kind == "normal" and o.code == "OK" and o.ttft is not None and start <= o.sent < end]
    if not ttft:
        return {"start_s": round(start, 1), "end_s": round(end, 1), "normal_ok": 0}
    return {"start_s": round(start, 1), "end_s": round(end, 1), "normal_ok": len(ttft),
            "ttft_p50_ms": round(quantile(ttft, 0.5), 1), "ttft_p99_ms": round(quantile(ttft, 0.99), 1)}


async def _idle_blocks(fleet: SoakFleet, timeout_s: float = 60.0) -> dict[str, dict]:
    """Each live replica's Stats once nothing runs or waits (or at the timeout)."""
    out = {}
    for rid, address in fleet.addresses.items():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            deadline = time.monotonic() + timeout_s
            while True:
                s = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                if (s.running == 0 and s.waiting == 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        out[rid] = {"running": s.running, "waiting": s.waiting, "free": s.num_free_blocks,
                    "total": s.num_total_blocks}
    return out


async def soak(fleet: SoakFleet, a: argparse.Namespace) -> dict:
    from bench.cluster.router_bench import wait_registered

    await wait_registered(fleet.router_address, a.replicas)
    duration = a.minutes * 60
    load = Load(fleet.router_address, fleet.spec.stream_stall_s)
    rss_start = {role: rss_bytes(pid) for role, pid in fleet.pids().items()}
    faults: list[dict] = []
    async with grpc.aio.insecure_channel(fleet.router_address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        clients = [asyncio.create_task(load.client(stub)) for _ in range(a.clients)]
        loop = asyncio.get_running_loop()
        victim = f"replica-{a.replicas - 1}"
        for at, name, down, up in (
                (0.3, "replica kill", lambda: fleet.kill_replica(victim),
                 lambda: fleet.start_replica(victim)),
                (0.6, "redis restart", fleet.stop_redis, fleet.start_redis_again)):
            await asyncio.sleep(max(0.0, at * duration - load.now()))
            start = load.now()
            await loop.run_in_executor(None, down)
            await asyncio.sleep(a.down_s)
            await loop.run_in_executor(None, up)
            faults.append({"fault": name, "start_s": start, "back_s": load.now(),
                           **({"replica": victim} if name == "replica kill" else {})})
        await asyncio.sleep(max(0.0, duration - load.now()))
        load.stopping = True
        await asyncio.gather(*clients)
    blocks = await _idle_blocks(fleet)
    rss_end = {role: rss_bytes(pid) for role, pid in fleet.pids().items()}
    return report(load.outcomes, faults, duration, blocks, rss_start, rss_end)


def report(outs: list[Outcome], faults: list[dict], duration: float, blocks: dict,
           rss_start: dict, rss_end: dict, settle_s: float = 5.0) -> dict:
    """The soak's numbers; a fault's window runs from its start to ``settle_s`` after it is
    back, "after" from there to the next fault (or the end)."""
    windows: dict[str, tuple[float, float]] = {}
    for i, f in enumerate(faults):
        settled = f["back_s"] + settle_s
        if i == 0:
            windows[f"before {f['fault']}"] = (0.0, f["start_s"])
        windows[f"during {f['fault']}"] = (f["start_s"], settled)
        nxt = faults[i + 1]["start_s"] if i + 1 < len(faults) else duration + 1.0
        windows[f"after {f['fault']}"] = (settled, nxt)
    in_fault = [(f["start_s"], f["back_s"] + settle_s) for f in faults]
    unexpected = Counter()
    for o in outs:
        if o.code not in EXPECTED[o.kind]:
            where = "in a fault window" if any(s <= o.end and o.sent < e for s, e in in_fault) \
                else "outside faults"
            unexpected[f"{o.kind} {o.code} ({where})"] += 1
    by_kind = {k: dict(Counter(o.code for o in outs if o.kind == k)) for k in KINDS}
    return {
        "requests": len(outs), "by_kind": by_kind,
        "unexpected": dict(unexpected),
        # replicas restarted by a fault: their RSS "end" is the new process's
        "restarted": [f["replica"] for f in faults if "replica" in f],
        "blocks_leaked": sum(b["total"] - b["free"] for b in blocks.values()),
        "replicas_idle": blocks, "faults": faults,
        "ttft_by_window": {name: _window_stats(outs, s, e) for name, (s, e) in windows.items()},
        "rss_mib": {role: {"start": round(rss_start.get(role, 0) / 2**20, 1),
                           "end": round(rss_end.get(role, 0) / 2**20, 1)}
                    for role in sorted(set(rss_start) | set(rss_end))},
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--down-s", type=float, default=5.0, help="seconds each fault lasts")
    p.add_argument("--scale", type=float, default=0.05)
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.replicas < 2 or a.clients < 1 or a.down_s < 0:
        p.error("--minutes > 0, --replicas >= 2 (one is killed), --clients >= 1, --down-s >= 0")
    from kvfleet.deploy.models import DEFAULT_MODEL, resolve_model

    name, model_dir = resolve_model(DEFAULT_MODEL)
    fleet = SoakFleet(FleetSpec(name, str(model_dir), replicas=a.replicas, scale=a.scale))
    load_before = os.getloadavg()
    try:
        fleet.start()
        result = asyncio.run(soak(fleet, a))
    finally:
        fleet.stop()
    record = {"args": vars(a), "spec": asdict(fleet.spec), **result,
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0 if result["blocks_leaked"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
