"""HTTP front vs gRPC on the same router and worker: added TTFT and throughput.

    .venv/bin/python -m bench.cluster.http_front

One router process serving both its gRPC port and its HTTP front (``--http-port``), one
cost-model replica that answers at once (so the router and the transports are what is
measured). The same Poisson stream (1,024-token shared prefix + 64 unique tokens as token ids,
one output token) goes through ``Router.Generate`` (gRPC, bench.common.load.Target) and through
``POST /v1/completions`` streamed over SSE with a plain httpx client (bench.common.load.HttpTarget),
in rotating segments; HTTP's added TTFT = its quantile − gRPC's. Then closed-loop throughput
(``--concurrency`` clients, ``--tokens`` streamed tokens each) through each transport, and the
router process's CPU per request in those phases (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench.cluster.router_cost import added_ttft, cpu_seconds
from bench.cluster.zero_fleet import zero_fleet
from bench.common.load import HttpTarget, Target, closed_loop
from bench.common.result_file import write_json
from bench.common.workload import Workload, requests


async def throughput(target, pid: int, concurrency: int, seconds: float) -> dict:
    w = Workload(groups=1, prefix_tokens=1024, suffix_tokens=64)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    res = await closed_loop(target, requests(w, float("inf"), 100_000, seed=7), concurrency,
                            seconds)
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    ok = [r for r in res if r.ok]
    return {"requests_per_s": len(ok) / wall, "errors": len(res) - len(ok),
            "tokens_per_s": len(ok) * target.max_tokens / wall,
            "router_cpu_ms_per_request": cpu / max(1, len(ok)) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.http_front", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="30", help="requests/s for the TTFT test")
    p.add_argument("--segment", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6, help="segments per transport and rate")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="output tokens per throughput request")
    p.add_argument("--seconds", type=float, default=10.0, help="per throughput phase")
    a = p.parse_args(argv)

    with zero_fleet("bench-http:", http=True) as fleet:
        cluster = fleet.cluster

        async def run() -> dict:
            from bench.cluster.router_bench import wait_registered

            await wait_registered(cluster.router_address, 1)
            grpc_t = Target(cluster.router_address, max_tokens=1)
            http_t = HttpTarget(cluster.http_address, max_tokens=1)
            out: dict = {"added_ttft": []}
            for rate in a.rates.split(","):  # "direct" = gRPC, "http" = the HTTP front
                got = await added_ttft(grpc_t, {"http": http_t}, float(rate), a.segment, a.rounds)
                out["added_ttft"].append(got)
                print(json.dumps(got), flush=True)
            pid = cluster.router_proc.pid
            long_g = Target(cluster.router_address, max_tokens=a.tokens)
            long_h = HttpTarget(cluster.http_address, max_tokens=a.tokens)
            out["throughput"] = {}
            for rnd in range(2):  # interleaved: gRPC, HTTP, gRPC, HTTP
                for key, target in (("grpc", long_g), ("http", long_h)):
                    got = await throughput(target, pid, a.concurrency, a.seconds)
                    out["throughput"].setdefault(key, []).append(got)
                    print(key, json.dumps(got), flush=True)
            for t in (grpc_t, http_t, long_g, long_h):
                await t.close()
            return out

        out = asyncio.run(run())
    write_json("http_front.json", out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
