"""Tensor parallelism on CPU: tp=1 (2 threads) vs tp>1 (1 thread per rank), collectives' share.

    .venv/bin/python -m bench tp [--quick] [--rounds N] [--models seeded,smollm2] [--out DIR]

Same step plans for every configuration, one run, fp32, rounds interleaved (tp=1, tp=T gloo,
tp=T shm, then reversed, ...) so a noisy neighbour hurts both; each round's medians are kept and the report
gives the median [min–max] over rounds. Models: a seeded Llama (hidden 1024, 8 layers, 16
query / 8 KV heads, FFN 2816, vocab 32000; built once into the kvfleet cache) at tp=1 vs tp=2,
and SmolLM2-135M (9 query / 3 KV heads, 30 layers) at tp=1 vs tp=3 (3 ranks on 2 cores).
Ranks 1..T-1 are Ray actors (``init_ray(num_cpus=2)``); rank 0 is this process.

Per configuration: decode step time (ms) at batch 1, 4, 16 with 128 tokens of context each,
prefill tokens/s of one fresh 256-token chunk, the share of rank 0's step spent in collectives
(``RankComm.all_reduce`` + the plan's ``send``, from ``CommTimes``; waiting for a slower rank
included), rank 1's all-reduce time per step (the rank that arrives last waits least, so the
smaller of the two is closer to the collective's own cost), and the LM head's share of rank 0's
step (``compute_logits``). Each TP size runs twice: all-reduces on gloo, and through the
same-host shared-memory all-reduce (``TPSettings(shm_all_reduce=True)``,
:mod:`kvfleet.worker.executor.tp.shm_reduce`). Last, both all-reduces' latency between 2 idle
processes at the sizes a decode step reduces (``bench/engine/shm_allreduce.py``). Target:
collectives ≤ 25 % of the tp=2 decode step. JSON and a PNG go to ``--out`` (default ``bench/results/tp``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.common.plots import lines_plot
from bench.engine import tp_runs as tr

TARGET_SHARE = 0.25
MODELS = {"seeded": 2, "smollm2": 3}  # model → the tp compared with tp=1


def _model_dir(name: str) -> Path:
    from kvfleet.deploy.models import prepare_model

    return tr.seeded_llama_dir() if name == "seeded" else prepare_model(progress=False)


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_model(name: str, tp: int, args: argparse.Namespace) -> dict:
    """Interleaved rounds of tp=1 and tp=``tp`` on one model; the JSON record."""
    model_dir = _model_dir(name)
    num_blocks = tr.blocks_needed(max(args.batches), args.context, args.prefill)
    setups = [tr.make_setup(model_dir, 1, num_blocks), tr.make_setup(model_dir, tp, num_blocks),
              tr.make_setup(model_dir, tp, num_blocks, shm=True)]
    rounds: dict = {s.name: {"decode": {b: [] for b in args.batches}, "prefill": [],
                             "peer_reduce_s": {b: [] for b in args.batches}} for s in setups}
    try:
        for s in setups:
            tr.prefill_contexts(s, max(args.batches), args.context)
        for r in range(args.rounds):
            for s in (setups if r % 2 == 0 else setups[::-1]):  # A B C, C B A, ...
                for b in args.batches:
                    summary, peers = tr.decode_round(s, b, args.context, args.repeats)
                    rounds[s.name]["decode"][b].append(summary)
                    if peers:
                        rounds[s.name]["peer_reduce_s"][b].append(peers[0])
                rounds[s.name]["prefill"].append(tr.prefill_round(
                    s, args.prefill, max(args.batches), args.context, max(2, args.repeats // 5)))
            print(f"  {name}: round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for s in setups:
            s.close()
    return {"model": name, "model_dir": str(model_dir), "tp": tp,
            "configs": {n: _aggregate(v) for n, v in rounds.items()}, "rounds_raw": rounds}


def _aggregate(v: dict) -> dict:
    out = {"decode": {}, "prefill": {}}
    for b, rs in v["decode"].items():
        out["decode"][b] = {k: _spread([r[k] for r in rs])
                            for k in ("step_s", "reduce_s", "send_s", "head_s",
                                      "collective_share", "head_share")}
        out["decode"][b]["reduces_per_step"] = rs[0]["reduces_per_step"]
        if v["peer_reduce_s"][b]:
            out["decode"][b]["peer_reduce_s"] = _spread(v["peer_reduce_s"][b])
    ps = v["prefill"]
    out["prefill"] = {k: _spread([r[k] for r in ps])
                      for k in ("tokens_per_s", "step_s", "collective_share", "head_share")}
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def report(results: list[dict], lat: dict | None) -> None:
    for rec in results:
        print(f"\n{rec['model']} (tp=1 vs tp={rec['tp']}), medians over rounds [min–max]")
        print(f"{'config':28s} {'batch':>5s} {'step ms':>18s} {'collect.':>8s} {'ar/step':>7s} "
              f"{'ar ms r0/r1':>12s} {'plan ms':>7s} {'head':>6s}")
        for cname, cfg in rec["configs"].items():
            for b, row in cfg["decode"].items():
                st = row["step_s"]
                peer = row.get("peer_reduce_s", {}).get("median")
                ar = (f"{1e3 * row['reduce_s']['median']:.1f}/{1e3 * peer:.1f}" if peer is not None
                      else "-")
                print(f"{cname:28s} {b:5d} {1e3 * st['median']:6.1f} [{1e3 * st['min']:.1f}–"
                      f"{1e3 * st['max']:.1f}] {_pct(row['collective_share']['median']):>8s} "
                      f"{row['reduces_per_step']:7d} {ar:>12s} {1e3 * row['send_s']['median']:7.2f} "
                      f"{_pct(row['head_share']['median']):>6s}")
            p = cfg["prefill"]
            print(f"{cname:28s} prefill {p['tokens_per_s']['median']:.0f} tok/s "
                  f"[{p['tokens_per_s']['min']:.0f}–{p['tokens_per_s']['max']:.0f}], collectives "
                  f"{_pct(p['collective_share']['median'])}, head {_pct(p['head_share']['median'])}")
    if lat:
        print("\nall-reduce between 2 processes, median per call (µs): size (floats) gloo / shm")
        for size in lat["gloo"]:
            print(f"  {size:6d}  {1e6 * lat['gloo'][size]:7.1f} / {1e6 * lat['shm'][size]:6.1f}")
        print(f"  shm sums bit-identical to gloo: {lat['exact']}")
    print(f"\ntarget: collectives ≤ {_pct(TARGET_SHARE)} of the TP decode step")


def plot(results: list[dict], out: Path) -> Path:
    series = {}
    for rec in results:
        for cname, cfg in rec["configs"].items():
            bs = sorted(cfg["decode"])
            series[f"{rec['model']} {cname}"] = (bs, [1e3 * cfg["decode"][b]["step_s"]["median"]
                                                      for b in bs])
    return lines_plot(out / "tp_decode_step.png", series,
                      "decode step (ms, median of rounds) vs batch, 128-token context",
                      "batch (sequences)", "ms per step")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench tp", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round, fewer steps (smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15, help="timed decode steps per round")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--context", type=int, default=128, help="tokens of context per decode sequence")
    p.add_argument("--prefill", type=int, default=256, help="tokens of the timed prefill chunk")
    p.add_argument("--models", default="seeded,smollm2")
    p.add_argument("--no-shm", action="store_true", help="skip the gloo vs shm all-reduce run")
    p.add_argument("--out", type=Path, default=Path("bench/results/tp"))
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.rounds, args.repeats, args.batches, args.prefill = 1, 5, [1, 4], 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvfleet.deploy.ray_local import init_ray, shutdown_ray

    start, load_before = time.time(), os.getloadavg()
    init_ray(num_cpus=2)
    try:
        results = [bench_model(m, MODELS[m], args) for m in args.models.split(",")]
    finally:
        shutdown_ray()
    lat = None
    if not args.no_shm:
        from bench.engine.shm_allreduce import pair_latencies

        hidden = sorted({h * b for h in (576, 1024) for b in args.batches})
        lat = pair_latencies(hidden, calls=50 if args.quick else 200, rounds=1 if args.quick else 3)
    report(results, lat)
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(results, args.out)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "seconds": time.time() - start,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "results": results, "allreduce_latency_s": lat}
    path = args.out / "tp_bench.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"\n{time.time() - start:.0f} s; 1-min load average {load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs); wrote {path} and {png}")
    return 0
