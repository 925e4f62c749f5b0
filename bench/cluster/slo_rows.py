"""The client-side SLO table's rows on a real cluster: ITL target off vs on, per row.

    .venv/bin/python -m bench slo_rows [--rows 1,2,3] [--runs 1] [--seed 0]
        [--seconds 60] [--target-x 3] [--itl-target-ms MS] [--streams 4] [--prompt 480]
        [--period 1.5] [--class-seconds 30] [--class-target-ms 150] [--settings off,on]
        [--up-arg=--reserved-cpus=0 ...]

``--runs N`` repeats each row with seeds ``--seed`` .. ``--seed + N - 1``; a compact table of
every row, seed and setting is printed at the end. ``--settings`` (rows 2-3) runs only the
named target settings (``on`` for row 2's judged one, ``off`` for row 3's): repeats of the
judged half in half the time; row 1 always runs both (its target comes from the off run).
Row 1 is below; rows 2 and 3 (classes, fairness, on cost-model replicas, ``--class-seconds``
per phase, target ``--class-target-ms``) are :mod:`bench.cluster.slo_class_rows`.

Row 1:

One real replica of the default model (SmolLM2-135M) behind the router, started from
``kvfleet up``'s own flags (:class:`~kvfleet.deploy.launcher.LocalCluster`: Redis, local Ray,
router process), once without and once with ``--itl-target-ms``; in each, seeded and the same:
``--streams`` greedy decode streams (64-token prompts, 256 tokens each, replaced when done)
and a ``--prompt``-token request (16 tokens) every ``--period`` seconds, for ``--seconds``.
The target is ``--itl-target-ms``, or ``--target-x`` × the single-stream ITL p50 measured
first on the target-off cluster (one stream alone). Each cluster runs in a process of its own
(Ray and Serve start clean). Every streamed message is timestamped at
the client (``time.monotonic``): the streams' ITL is the gap between a stream's messages
carrying tokens; the long prompts' TTFT is send to first token. Reported per run and on ÷ off:
ITL p50 / p99 and p99 ÷ p50, output tokens/s (those that arrived within ``--seconds``),
long-prompt TTFT p50 / p99, and whether every
request's greedy tokens were identical in both runs (targets: p99 ≤ 3 × p50, ≥ 0.85 × tok/s,
long TTFT p99 ≤ 2 ×). The host's load average is recorded beside the numbers: on a loaded host
they measure the load as much as the policy. JSON: ``bench/results/slo_rows.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Optional

from bench.common.result_file import RESULTS
from bench.common.stream_stats import pct, stream_row

STREAM_PROMPT, STREAM_TOKENS, LONG_TOKENS = 64, 256, 16


@dataclass
class Stream:
    """One request as the client saw it: every message's arrival time and token count."""

    kind: str  # "stream" | "long"
    index: int
    sent: float
    stamps: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str = ""


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def generate(stub, ids: list[int], max_tokens: int, kind: str, index: int) -> Stream:
    """One greedy ``Router.Generate``; never raises (an error is recorded)."""
    import grpc

    from kvfleet.v1 import router_pb2

    req = router_pb2.GenerateRequest()
    req.token_ids.ids.extend(ids)
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    req.sampling.temperature = 0.0
    out = Stream(kind, index, time.monotonic())
    try:
        async for m in stub.Generate(req, timeout=600.0):
            if m.token_ids:
                out.stamps.append((time.monotonic(), len(m.token_ids)))
                out.tokens.extend(m.token_ids)
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


async def workload(address: str, seconds: float, streams: int, long_prompt: int,
                   period: float, seed: int = 0) -> list[Stream]:
    """The row's load for ``seconds``; the same requests (by kind and index) in every run."""
    import grpc

    from kvfleet.grpc_util import CHANNEL_OPTIONS
    from kvfleet.v1 import router_pb2_grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        await generate(stub, prompt(random.Random(-1), 16), 4, "warm", 0)  # warm-up
        end = time.monotonic() + seconds

        async def stream_loop(k: int) -> list[Stream]:
            done, i = [], 0
            while time.monotonic() < end:
                ids = prompt(random.Random(seed * 1000 + k * 100 + i), STREAM_PROMPT)
                done.append(await generate(stub, ids, STREAM_TOKENS, "stream", k * 100 + i))
                i += 1
            return done

        async def long_loop() -> list[Stream]:
            tasks, i, t0 = [], 0, time.monotonic()
            while time.monotonic() < end:
                ids = prompt(random.Random(seed * 1000 + 50_000 + i), long_prompt)
                tasks.append(asyncio.create_task(generate(stub, ids, LONG_TOKENS, "long", i)))
                i += 1
                await asyncio.sleep(max(0.0, t0 + i * period - time.monotonic()))
            return list(await asyncio.gather(*tasks))

        parts = await asyncio.gather(long_loop(), *(stream_loop(k) for k in range(streams)))
    return [s for part in parts for s in part]


async def single_stream_itl(address: str, tokens: int = 64) -> float:
    """ITL p50 (s) of one stream alone."""
    import grpc

    from kvfleet.grpc_util import CHANNEL_OPTIONS
    from kvfleet.v1 import router_pb2_grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        await generate(stub, prompt(random.Random(-2), 16), 4, "warm", 0)
        s = await generate(stub, prompt(random.Random(-3), STREAM_PROMPT), tokens, "alone", 0)
    gaps = [b[0] - a[0] for a, b in zip(s.stamps, s.stamps[1:], strict=False)]
    return pct(gaps, 0.5)


def summarize(runs: list[Stream], seconds: float) -> dict:
    """The run's stream row: output tokens/s counts the tokens that arrived within the
    ``seconds`` from the first request's send (the requests still running then finish, and
    their later tokens are not the window's: counting whole requests would count a stream's
    last 256-token request in full or not at all)."""
    itl = [b[0] - a[0] for s in runs if s.kind == "stream"
           for a, b in zip(s.stamps, s.stamps[1:], strict=False)]
    ttft = [s.stamps[0][0] - s.sent for s in runs if s.kind == "long" and s.stamps]
    end = min((s.sent for s in runs), default=0.0) + seconds
    tokens = sum(n for s in runs for t, n in s.stamps if t <= end)
    return {**stream_row(itl, ttft, tokens / seconds),
            "errors": sorted({s.error for s in runs if s.error})[:5]}


def identical(off: list[Stream], on: list[Stream]) -> dict:
    """Requests present (and complete) in both runs, and whether their tokens match."""
    a = {(s.kind, s.index): s.tokens for s in off if not s.error}
    b = {(s.kind, s.index): s.tokens for s in on if not s.error}
    both = [k for k in a if k in b and len(a[k]) == len(b[k])]
    return {"compared": len(both), "identical": all(a[k] == b[k] for k in both)}


def run_cluster(flags: list[str], body) -> object:
    """Start ``kvfleet up FLAGS`` (router on a free port), run ``body(address)``, stop it."""
    from dataclasses import replace

    from kvfleet.deploy import cli
    from kvfleet.deploy.cluster_flags import cluster_config
    from kvfleet.deploy.launcher import LocalCluster

    cfg = cluster_config(cli.build_parser().parse_args(["up", *flags]))
    cluster = LocalCluster(replace(cfg, router=replace(cfg.router, port=0)))
    try:
        address = cluster.start(timeout_s=900.0)
        return body(address)
    finally:
        cluster.stop()


def phase(a: argparse.Namespace) -> None:
    """One cluster (``--phase off|on``) in this process; the raw streams go to ``--dump``."""
    from dataclasses import asdict

    base = ["--replicas", "1", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
            *a.up_args]
    flags = base if a.phase == "off" else [*base, "--itl-target-ms", f"{a.itl_target_ms:.0f}"]

    def body(address: str) -> dict:
        single = asyncio.run(single_stream_itl(address)) if a.phase == "off" else None
        runs = asyncio.run(workload(address, a.seconds, a.streams, a.prompt, a.period, a.seed))
        return {"single": single, "runs": [asdict(r) for r in runs]}

    with open(a.dump, "w") as f:
        json.dump(run_cluster(flags, body), f)


def run_phase(a: argparse.Namespace, name: str, target_ms: Optional[float]) -> dict:
    """``phase`` in a fresh process (Ray and Serve start clean for each cluster)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, "-m", "bench", "slo_rows", "--phase", name, "--dump", tmp.name,
               "--seconds", str(a.seconds), "--streams", str(a.streams), "--prompt",
               str(a.prompt), "--period", str(a.period), "--seed", str(a.seed)]
        if target_ms is not None:
            cmd += ["--itl-target-ms", str(target_ms)]
        cmd += [f"--up-arg={arg}" for arg in a.up_args]
        subprocess.run(cmd, check=True)
        with open(tmp.name) as f:
            data = json.load(f)
    data["runs"] = [Stream(**{**r, "stamps": [tuple(x) for x in r["stamps"]]})
                    for r in data["runs"]]
    return data


def row1(a: argparse.Namespace) -> dict:
    """Row 1 once (seed ``a.seed``): target off, then on; the result's summary."""
    load: dict = {"start": os.getloadavg()}
    first = run_phase(a, "off", None)
    off, single = first["runs"], first["single"]
    target_ms = a.itl_target_ms or a.target_x * single * 1e3
    print(f"single-stream ITL p50 {single * 1e3:.0f} ms; target {target_ms:.0f} ms", flush=True)
    load["between"] = os.getloadavg()
    on = run_phase(a, "on", target_ms)["runs"]
    load["end"] = os.getloadavg()
    r_off, r_on = summarize(off, a.seconds), summarize(on, a.seconds)
    return {"single_stream_itl_p50_s": single, "target_ms": target_ms, "off": r_off,
            "on": r_on, "ratios": {
                "tokens_per_s": r_on["tokens_per_s"] / r_off["tokens_per_s"],
                "long_ttft_p99": r_on["long_ttft_p99_s"] / r_off["long_ttft_p99_s"]},
            "outputs": identical(off, on), "load_average": load}


def row1_line(seed: int, r: dict) -> str:
    off, on = r["off"], r["on"]
    return (f"row 1 seed {seed} target {r['target_ms']:.0f} ms | ITL p99/p50 "
            f"{off['itl_p99_over_p50']:.2f} -> {on['itl_p99_over_p50']:.2f} (<= 3; p50 "
            f"{off['itl_p50_s'] * 1e3:.0f} -> {on['itl_p50_s'] * 1e3:.0f} ms) | tok/s "
            f"{r['ratios']['tokens_per_s']:.2f}x (>= 0.85) | long TTFT p99 "
            f"{off['long_ttft_p99_s']:.2f} -> {on['long_ttft_p99_s']:.2f} s "
            f"({r['ratios']['long_ttft_p99']:.2f}x, <= 2) | identical "
            f"{r['outputs']['identical']} ({r['outputs']['compared']}) "
            f"| load {r['load_average']['end'][0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    from bench.cluster import slo_class_rows

    p = argparse.ArgumentParser(prog="python -m bench slo_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1", help="comma-separated rows of the table: 1,2,3")
    p.add_argument("--runs", type=int, default=1, help="runs of each row (seeds seed..)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt", type=int, default=480)
    p.add_argument("--period", type=float, default=1.5)
    p.add_argument("--target-x", type=float, default=3.0)
    p.add_argument("--itl-target-ms", type=float, default=None)
    p.add_argument("--class-seconds", type=float, default=30.0,
                   help="rows 2-3: seconds per phase")
    p.add_argument("--class-target-ms", type=float, default=150.0,
                   help="rows 2-3: the replicas' ITL target (the cost model's milliseconds)")
    p.add_argument("--up-arg", action="append", default=[], dest="up_args",
                   help="row 1: a further `kvfleet up` flag for both clusters, e.g. "
                        "--up-arg=--reserved-cpus=0 (repeatable)")
    p.add_argument("--settings", default="off,on",
                   help="rows 2-3: comma-separated target settings to run (off, on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "slo_rows.json"))
    p.add_argument("--phase", choices=("off", "on"), help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        phase(a)
        return 0
    rows = sorted({int(r) for r in a.rows.split(",")})
    settings = [k for k in ("off", "on") if k in a.settings.split(",")]
    if not set(rows) <= {1, 2, 3} or a.runs < 1:
        p.error("--rows takes 1, 2 and 3; --runs must be >= 1")
    if not settings or not set(a.settings.split(",")) <= {"off", "on"}:
        p.error(f"--settings takes off and/or on, got {a.settings!r}")
    seeds = range(a.seed, a.seed + a.runs)
    result: dict = {"args": vars(a), "rows": {}}
    lines: list[str] = []
    if 1 in rows:
        result["rows"][1] = {s: row1(argparse.Namespace(**{**vars(a), "seed": s}))
                            for s in seeds}
        lines += [row1_line(s, r) for s, r in result["rows"][1].items()]
    fns = {2: slo_class_rows.row2, 3: slo_class_rows.row3}
    classed = {row: {s: {k: fns[row](s, t, a.class_seconds)
                         for k, t in (("off", None), ("on", a.class_target_ms)) if k in settings}
                     for s in seeds} for row in rows if row in fns}
    result["rows"].update(classed)
    lines += slo_class_rows.table_lines(classed)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(lines))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
