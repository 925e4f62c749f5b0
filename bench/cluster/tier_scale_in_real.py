"""Scale-in 3 -> 2 on real SmolLM2 replicas, with and without the drain hand-over.

    .venv/bin/python -m bench tier_scale_in_real [--rate 0.3] [--modes "hand-over,no hand-over"]

``bench/sim/tier_scale_in.py`` runs this scale-in on the virtual-time fleet; this one on real
replicas. Each mode is a fresh fleet in this process, as ``bench/cluster/tier_b2b_real.py`` builds it
(:class:`~bench.cluster.tier_b2b_real.RealFleet`): a private redis-server, a local Ray (this machine is
one Ray node, so every replica shares its host tier: the simulation's "same node" layout),
three ``ReplicaServer`` (SmolLM2 fp32, one torch thread each) and one ``RouterServer``
(prefix_aware, host hits credited at its default weight). The B2B stream
(``bench/common/workload.py``) is the same in every mode: ``--groups`` system prompts shared by
``--users`` users each, Poisson arrivals at ``--rate``. Its shared blocks are about the three
pools together (``--pool-blocks`` each), so two pools cannot hold them.

At ``--warmup-s`` + ``--window-s`` replica ``rep-2`` drains (``ReplicaServer.drain``: the
registry says draining at once, routers stop sending, its streams finish) while the stream
goes on, then

* ``hand-over``: it writes its hottest cached blocks to the node's tier (``kv_hand_over``,
  the default) before it deregisters;
* ``no hand-over``: it deregisters with them (``kv_hand_over=False``);
* ``no tier``: the same scale-in on a fleet without the host tier (reference).

Measured, from the clients' ``usage``: the hit rate (cached ÷ prompt tokens) of the requests
arriving in the window before the drain and in the window after it, and their ratio ("kept",
target ≥ 0.8); the prompt tokens admitted from the device / host tier in each window (the
workers' counters); TTFT p50 / p90 per window; blocks handed over; the process's peak RSS.
JSON in ``bench/results/tier_scale_in_real.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
from typing import Optional, Sequence

import grpc

from bench.cluster.tier_b2b_real import RealFleet, Sent, _one, _pct, on_local_cluster
from bench.common.result_file import write_json
from bench.common.workload import B2BWorkload, b2b_requests
from kvfleet.v1 import router_pb2_grpc

MODES = {"hand-over": (True, True), "no hand-over": (True, False), "no tier": (False, False)}
VICTIM = 2  # rep-2 drains


def _window(sent: Sequence[Sent], lo: float, hi: float) -> dict:
    """Client-side stats of the requests arriving in ``[lo, hi)`` seconds."""
    rs = [s for s in sent if lo <= s.request.offset_s < hi]
    ok = [s for s in rs if not s.error and s.ttft_s is not None]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    return {"n": len(rs), "errors": len(rs) - len(ok),
            "hit_rate": sum(s.cached for s in ok) / max(1, sum(len(s.request.token_ids)
                                                             for s in ok)),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
            "per_replica": {r: sum(1 for s in ok if s.replica == r)
                            for r in sorted({s.replica for s in ok})}}


def _split(a: dict[str, int], b: dict[str, int]) -> dict[str, float]:
    tokens = max(1, b["prompt_tokens"] - a["prompt_tokens"])
    return {t: (b[t] - a[t]) / tokens for t in ("device", "host")}


async def run_mode(a, model_dir: str, redis_url: str, mode: str, reqs, max_tokens: int) -> dict:
    """One fleet of 3: the stream, ``rep-2`` drained at ``warmup_s + window_s``."""
    tier, hand_over = MODES[mode]
    at = a.warmup_s + a.window_s
    marks: dict[float, dict[str, int]] = {}
    drained: dict = {}
    async with RealFleet(model_dir, redis_url, a.pool_blocks, tier, False, a.max_seqs,
                         count=3, kv_hand_over=hand_over, one_row_weights=False,
                         drain_timeout_s=a.drain_timeout_s) as fleet:
        victim = fleet.replicas[VICTIM]
        stub = router_pb2_grpc.RouterStub(channel := grpc.aio.insecure_channel(
            fleet.router.address))
        sent = [Sent(r) for r in reqs]
        t0 = time.monotonic()

        async def at_time(t: float) -> None:
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            marks[t] = fleet.hits()

        async def drain() -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            start = time.monotonic()
            ended = await victim.drain()
            drained.update(at_s=start - t0, drain_s=time.monotonic() - start,
                           ended_by_timeout=ended, handed_over_blocks=victim.handed_over_blocks,
                           victim_pool_blocks=victim.engine.kv.num_total_blocks)

        side = [asyncio.create_task(at_time(t)) for t in (a.warmup_s, at, at + a.window_s)]
        side.append(asyncio.create_task(drain()))
        tasks = []
        for s in sent:
            await asyncio.sleep(max(0.0, t0 + s.request.offset_s - time.monotonic()))
            tasks.append(asyncio.create_task(_one(stub, s.request, t0, max_tokens, s)))
        await asyncio.gather(*tasks, *side)
        await channel.close()
    before, after = _window(sent, a.warmup_s, at), _window(sent, at, at + a.window_s)
    m = marks
    return {"before": {**before, "admitted_by_tier": _split(m[a.warmup_s], m[at])},
            "after": {**after, "admitted_by_tier": _split(m[at], m[at + a.window_s])},
            "kept": after["hit_rate"] / before["hit_rate"] if before["hit_rate"] else None,
            "drain": drained, "wall_s": time.monotonic() - t0}


def _rss_mb() -> tuple[float, float]:
    """This process's (current, peak) resident set, MB (10^6 B; Linux reports KiB)."""
    now = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                now = int(line.split()[1]) * 1024 / 1e6
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


async def _run(a, model_dir: str, redis_url: str) -> dict:
    w = B2BWorkload(groups=a.groups, users_per_group=a.users, system_tokens=a.system_tokens,
                    user_tokens=a.user_tokens, question_tokens=16, output_tokens=8)
    end_s = a.warmup_s + 2 * a.window_s
    reqs = [r for r in b2b_requests(w, [(a.rate, int(a.rate * end_s * 2) + 10)], seed=a.seed)
            if r.offset_s < end_s]
    out: dict = {"args": vars(a), "cpus": os.cpu_count(), "requests": len(reqs),
                 "shared_blocks_over_pool": w.cache_blocks(16) / a.pool_blocks, "runs": {}}
    for mode in (m.strip() for m in a.modes.split(",")):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        load0 = os.getloadavg()[0]
        r = await run_mode(a, model_dir, redis_url, mode, reqs, w.output_tokens)
        rss, peak = _rss_mb()
        r.update(load_before=load0, load_after=os.getloadavg()[0], rss_mb=rss, rss_peak_mb=peak)
        out["runs"][mode] = r
        write_json(f"{a.out_name}.json", out)  # each mode as it ends
        b, f = r["before"], r["after"]
        print(f"{mode:13s} hit {b['hit_rate']:.3f} -> {f['hit_rate']:.3f} (kept "
              f"{r['kept']:.2f}; n {b['n']}/{f['n']}, errors {b['errors']}/{f['errors']}); "
              f"host share {b['admitted_by_tier']['host']:.3f} -> "
              f"{f['admitted_by_tier']['host']:.3f}; TTFT p90 {b['ttft_p90_s']:.2f} -> "
              f"{f['ttft_p90_s']:.2f} s; drain {r['drain']}; load {load0:.1f}->"
              f"{r['load_after']:.1f}; RSS {rss:.0f} MB (peak {peak:.0f} MB)", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench tier_scale_in_real",
                                description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=224)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--users", type=int, default=2, help="users per group")
    p.add_argument("--pool-blocks", type=int, default=36, help="KV blocks per replica")
    p.add_argument("--max-seqs", type=int, default=2, help="max_num_seqs per replica")
    p.add_argument("--rate", type=float, default=0.3, help="requests/s (Poisson)")
    p.add_argument("--warmup-s", type=float, default=90.0, help="not counted")
    p.add_argument("--window-s", type=float, default=60.0, help="before / after the drain")
    p.add_argument("--drain-timeout-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="hand-over,no hand-over",
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--out-name", default="tier_scale_in_real", help="bench/results/NAME.json")
    a = p.parse_args(argv)
    if not (a.rate > 0 and a.window_s > 0 and a.warmup_s >= 0):
        p.error("--rate and --window-s must be > 0, --warmup-s >= 0")
    out = on_local_cluster(lambda model_dir, redis_url: _run(a, model_dir, redis_url))
    write_json(f"{a.out_name}.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
