"""Autoscaling on the wall clock: ``kvfleet up --autoscale 1..MAX`` with cost-model
replicas under a ``bench.common.load`` ramp (up, hold, down, quiet tail): the fleet should go
1 → MAX → 1 with no failed request.

The cluster is built from ``kvfleet up``'s own flags (``--executor cost-model --autoscale …``),
with short Serve intervals so a run takes minutes. The ramp is sized from one replica's
saturated throughput on this workload, measured in virtual time on the same cost model
(``bench.sim.autoscale_sim.capacity_rps``): it holds at ``--peak`` × MAX of it, more than MAX − 1
replicas carry at the load target. Every second the bench records Serve's target, the
replicas serving (Serve's RUNNING ones: started, not stopping) and the policy's last reason;
every 10 s window gets the TTFT p99 of the requests sent in it. Printed, and written to
``bench/results/autoscale_wall.{json,png}``. Exit status 1 when a request failed.

    .venv/bin/python -m bench autoscale_wall
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

from bench.common.load import Result, Target, open_loop
from bench.common.workload import Workload
from bench.common.workload import requests as make_requests
from bench.sim.autoscale_sim import RESULTS, capacity_rps, poisson_arrivals

WINDOW_S = 10.0


def ramp(t: float, a: argparse.Namespace, peak_rps: float) -> float:
    """Requests/s at ``t``: ``--low`` × peak, up to the peak over ``--up-s``, held ``--hold-s``,
    back down over ``--down-s``, then ``--low`` × peak for ``--tail-s``."""
    low = a.low * peak_rps
    if t < a.up_s:
        return low + (peak_rps - low) * t / a.up_s
    t -= a.up_s
    if t < a.hold_s:
        return peak_rps
    t -= a.hold_s
    if t < a.down_s:
        return peak_rps - (peak_rps - low) * t / a.down_s
    return low


def cluster_config(a: argparse.Namespace):
    """``kvfleet up``'s config for these flags, with short Serve intervals."""
    from kvfleet.deploy import cli
    from kvfleet.deploy.cluster_flags import cluster_config as from_flags

    cfg = from_flags(cli.build_parser().parse_args(
        ["up", "--executor", "cost-model", "--cost-model-scale", f"{a.cost_scale:g}",
         "--max-num-seqs", "16", "--num-blocks", "512", "--autoscale", f"1..{a.max}",
         "--slo-ttft-ms", f"{a.slo_ttft_ms:g}", "--upscale-delay", f"{a.upscale_delay:g}",
         "--downscale-delay", f"{a.downscale_delay:g}"]))
    auto = replace(cfg.autoscale, look_back_period_s=a.look_back, metrics_interval_s=a.interval)
    return replace(cfg, router=replace(cfg.router, port=0), autoscale=auto,
                   replica_num_cpus=0.0)


def sample(app: str) -> dict:
    """Serve's target, the replicas serving, the policy's last reason (blocking calls)."""
    from kvfleet.deploy import serve_control
    from kvfleet.deploy.autoscale_serve import read_decision

    running = [r for r in serve_control.serve_replicas(app) if r.get("state") == "RUNNING"]
    decision = read_decision(app) or {}
    return {"target": serve_control.target_replicas(app), "serving": len(running),
            "reason": decision.get("reason", "")}


async def watch(app: str, t0: float, timeline: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        row = await asyncio.to_thread(sample, app)
        timeline.append({"t": time.monotonic() - t0, **row})
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def drive(a: argparse.Namespace, cluster, reqs) -> tuple[list[Result], list[dict]]:
    """Send the ramp; after it, keep watching until the fleet is back at 1 (or ``--settle-s``)."""
    target = Target(cluster.router_address)
    timeline: list[dict] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    watcher = asyncio.create_task(watch(cluster.app_name, t0, timeline, stop))
    results = await open_loop(target, reqs)
    settle = time.monotonic() + a.settle_s
    while time.monotonic() < settle and not (timeline and timeline[-1]["target"] == 1
                                             and timeline[-1]["serving"] == 1):
        await asyncio.sleep(1.0)
    stop.set()
    await watcher
    await target.channel.close()
    for r in results:  # times relative to the run's start, as the timeline's
        r.sent -= t0
        r.first = None if r.first is None else r.first - t0
        r.done = None if r.done is None else r.done - t0
    return results, timeline


def windows(results: list[Result], timeline: list[dict]) -> list[dict]:
    """Per 10 s: the last target and serving count, TTFT p99 of requests sent, failures."""
    end = max([row["t"] for row in timeline] + [r.sent for r in results])
    out = []
    for k in range(int(end // WINDOW_S) + 1):
        lo, hi = k * WINDOW_S, (k + 1) * WINDOW_S
        rows = [row for row in timeline if lo <= row["t"] < hi]
        sent = [r for r in results if lo <= r.sent < hi]
        ttft = sorted(r.ttft_s for r in sent if r.ok and r.first is not None)
        out.append({"t": lo, "target": rows[-1]["target"] if rows else None,
                    "serving": rows[-1]["serving"] if rows else None,
                    "reason": rows[-1]["reason"] if rows else "",
                    "requests": len(sent), "failed": sum(not r.ok for r in sent),
                    "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
                    if ttft else None})
    return out


def plot(rows: list[dict], slo_ms: float, path: Path) -> Path:
    from bench.common.plots import _pyplot, _save

    fig, (top, bottom) = _pyplot().subplots(2, 1, figsize=(8, 5), dpi=120, sharex=True)
    t = [r["t"] for r in rows]
    top.step(t, [r["target"] for r in rows], where="post", label="Serve's target")
    top.step(t, [r["serving"] for r in rows], where="post", label="replicas serving", ls="--")
    top.set_ylabel("replicas")
    top.legend(fontsize=8)
    bottom.plot([r["t"] for r in rows if r["ttft_p99_ms"]],
                [r["ttft_p99_ms"] for r in rows if r["ttft_p99_ms"]], marker=".")
    bottom.axhline(slo_ms, color="k", ls="--", lw=0.8, label="SLO")
    bottom.set_ylabel("TTFT p99 (ms), per 10 s")
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    from kvfleet.deploy.launcher import LocalCluster

    p = argparse.ArgumentParser(prog="bench.cluster.autoscale_wall", description=__doc__.split("\n\n")[0])
    p.add_argument("--max", type=int, default=3)
    p.add_argument("--peak", type=float, default=0.8,
                   help="held load, × MAX × one replica's saturated throughput")
    p.add_argument("--low", type=float, default=0.1, help="start and tail load, × the peak")
    p.add_argument("--up-s", type=float, default=90.0)
    p.add_argument("--hold-s", type=float, default=60.0)
    p.add_argument("--down-s", type=float, default=40.0)
    p.add_argument("--tail-s", type=float, default=30.0)
    p.add_argument("--settle-s", type=float, default=120.0,
                   help="after the ramp, wait at most this long for the fleet to reach 1")
    p.add_argument("--cost-scale", type=float, default=0.2)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--upscale-delay", type=float, default=2.0)
    p.add_argument("--downscale-delay", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=1.0, help="replica metrics interval (s)")
    p.add_argument("--look-back", type=float, default=6.0, help="Serve's look-back window (s)")
    p.add_argument("--out", type=Path, default=RESULTS / "autoscale_wall.json")
    a = p.parse_args(argv)
    cfg = cluster_config(a)
    w = Workload(groups=12, prefix_tokens=256, suffix_tokens=32, output_tokens=16, zipf_s=1.0)
    cap = capacity_rps(replace(cfg.replica, replica_id="cap"), cfg.replica.cost_model,
                       cfg.replica.scheduler, w, 400)
    peak = a.peak * a.max * cap
    duration = a.up_s + a.hold_s + a.down_s + a.tail_s
    offsets = poisson_arrivals(lambda t: ramp(t, a, peak), peak, duration, seed=0)
    stream = make_requests(w, float("inf"), len(offsets), seed=1)
    reqs = [replace(r, offset_s=t) for r, t in zip(stream, offsets, strict=True)]
    print(f"one replica {cap:.2f} req/s; ramp {a.low * peak:.2f} → {peak:.2f} req/s, "
          f"{len(reqs)} requests over {duration:.0f} s", flush=True)
    cluster = LocalCluster(cfg)  # its own Redis and local Ray, as `kvfleet up` starts them
    try:
        cluster.start()
        results, timeline = asyncio.run(drive(a, cluster, reqs))
    finally:
        cluster.stop()
    rows = windows(results, timeline)
    for r in rows:
        print(f"{r['t']:6.0f} s  target {r['target']}  serving {r['serving']}  "
              f"{r['requests']:4d} sent  {r['failed']} failed  TTFT p99 "
              f"{r['ttft_p99_ms'] or 0:7.0f} ms  {r['reason']}")
    targets = [row["target"] for row in timeline]
    top = max(targets, default=0)
    summary = {"capacity_rps": cap, "peak_rps": peak, "requests": len(results),
               "failed": sum(not r.ok for r in results), "max_target": top,
               "went_up_and_back": bool(targets) and targets[0] == 1 and top == a.max
               and timeline[-1]["target"] == 1 and timeline[-1]["serving"] == 1,
               "errors": sorted({r.error for r in results if r.error})[:5]}
    print(json.dumps(summary))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "summary": summary,
                                 "windows": rows, "timeline": timeline}, indent=1))
    print("plot:", plot(rows, a.slo_ttft_ms, a.out.with_suffix(".png")))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
