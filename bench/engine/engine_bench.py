"""Engine throughput vs transformers generate (A: one at a time, B: static batches of 16).

    .venv/bin/python -m bench engine [--quick] [--rounds N] [--models tiny,smollm2] [--out DIR]

One run, same request list for everyone, fp32, greedy, EOS disabled, 2 torch threads each.
Per model, rounds interleave A, B and kvfleet (A/B/K, A/B/K, ...), and each system's best
round counts, so a noisy neighbour hurts all three alike; the spread across rounds is printed.
Workloads: a seeded tiny Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, FFN 1024, vocab
32000) with 64 requests, prompts uniform in 16-512 tokens and outputs in 8-256; SmolLM2-135M
with 32 requests, prompts 16-512, outputs 8-128. Also: this machine's read bandwidth and
SmolLM2's batch-1 decode step against its roofline, TTFT with a cached 1,024-token prefix ÷
cold, decode step latency against context (PNG, matplotlib), and KV-pool waste under ``watermark``.
Results (JSON + PNG) go to ``--out`` (default ``bench/results/engine``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from bench.common.plots import line_plot
from bench.common.result_file import RESULTS
from bench.common.seeded import seeded_llama_dir
from bench.common.stream_stats import pct
from bench.engine import engine_runs as er
from bench.engine.engine_baselines import RunResult, load_hf, run_single, run_static_batches
from kvfleet.deploy.models import prepare_model
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig

NEAR_TIE = 1e-4
TINY = dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=1024, max_position_embeddings=1024,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TARGETS = {"tiny": (2.5, 10.0), "smollm2": (1.8, 6.0)}  # × baseline B, × baseline A


def tiny_llama_dir() -> Path:
    """The seeded tiny Llama, built once into the kvfleet cache (SmolLM2's tokenizer)."""
    return seeded_llama_dir("tiny-llama-h256-l4-v32000", TINY)


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 32000) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def agreement(a: RunResult, k: RunResult) -> dict:
    """Requests whose tokens differ from baseline A; a first difference at a near-tie (A's top-2
    logit gap < 1e-4 there) is reported as such, any other is a failure."""
    cases = []
    for i, (ta, tk) in enumerate(zip(a.tokens, k.tokens, strict=True)):
        if ta != tk:
            j = next((j for j, (x, y) in enumerate(zip(ta, tk)) if x != y), min(len(ta), len(tk)))
            gap = a.gaps[i][j] if j < len(a.gaps[i]) else float("nan")
            cases.append({"request": i, "step": j, "top2_gap": gap, "near_tie": gap < NEAR_TIE})
    return {"identical": len(a.tokens) - len(cases), "of": len(a.tokens), "differences": cases,
            "ok": all(c["near_tie"] for c in cases)}


def summary(r: RunResult) -> dict:
    return {"system": r.system, "wall_s": r.wall_s, "output_tokens": r.num_output_tokens,
            "tokens_per_s": r.tokens_per_s, "ttft_p50_s": pct(r.ttft_s, 0.5),
            "ttft_p99_s": pct(r.ttft_s, 0.99), "itl_p50_s": pct(r.itl_s, 0.5),
            "itl_p99_s": pct(r.itl_s, 0.99), **r.extra}


def bench_model(name: str, model_dir: Path, requests, rounds: int, config: SchedulerConfig) -> dict:
    print(f"\n== {name}: {len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens; {rounds} round(s) A/B/K", flush=True)
    hf = load_hf(model_dir)
    num_blocks = 16 * -(-max(len(p) + n for p, n in requests) // er.BLOCK_SIZE) + 64
    factory = er.EngineFactory(model_dir, num_blocks, config)
    er.run_engine(factory, requests[:2])  # warm-up (not timed)
    runs: dict[str, list[RunResult]] = {"A": [], "B": [], "K": []}
    for rnd in range(rounds):
        runs["A"].append(run_single(hf, requests))
        runs["B"].append(run_static_batches(hf, requests, 16))
        runs["K"].append(er.run_engine(factory, requests))
        print(f"  round {rnd + 1}: " + ", ".join(f"{k} {v[-1].tokens_per_s:7.1f} tok/s"
                                                 for k, v in runs.items()), flush=True)
    best = {k: max(v, key=lambda r: r.tokens_per_s) for k, v in runs.items()}
    agree = [agreement(runs["A"][i], runs["K"][i]) for i in range(rounds)]
    out = {
        "best": {k: summary(r) for k, r in best.items()},
        "spread_tokens_per_s": {k: [r.tokens_per_s for r in v] for k, v in runs.items()},
        "speedup_vs_B": best["K"].tokens_per_s / best["B"].tokens_per_s,
        "speedup_vs_A": best["K"].tokens_per_s / best["A"].tokens_per_s,
        "agreement_with_A": agree[0] | {"all_rounds_ok": all(a["ok"] for a in agree)},
        "hf_batch1_itl_p50_s": pct(best["A"].itl_s, 0.5),
    }
    del hf
    return out | {"_factory": factory}


def single_request_checks(factory: er.EngineFactory, quick: bool, out_dir: Path) -> dict:
    """SmolLM2 alone: roofline, prefix reuse, decode latency against context."""
    bw = max(er.read_bandwidth_gbs() for _ in range(2))
    ctx = 128
    step = min(er.decode_step_s(factory, list(range(100, 100 + ctx)), 32 if quick else 64) for _ in range(2))
    c = factory.runner.config
    kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * (ctx + 32)
    roofline = (er.weight_bytes_per_decode(factory.runner) + kv_bytes) / (bw * 1e9)
    rng = random.Random(7)
    prefix = [rng.randrange(100, 32000) for _ in range(1024)]
    suffixes = [[rng.randrange(100, 32000) for _ in range(16)] for _ in range(8)]
    cold, warm = [], []
    for i in range(2 if quick else 3):
        cold.append(er.ttft_alone(factory, factory.engine(), prefix + suffixes[2 * i])[0])
        engine = factory.engine()
        er.ttft_alone(factory, engine, prefix + suffixes[2 * i])  # caches the prefix
        t, cached = er.ttft_alone(factory, engine, prefix + suffixes[2 * i + 1])
        assert cached == 1024, cached
        warm.append(t)
    contexts = [16, 256, 512, 1024] if quick else [16, 256, 512, 1024, 1536, 2048]
    curve = er.decode_latency_curve(factory.runner, contexts)
    png = out_dir / "decode_latency_vs_context.png"
    line_plot(png, contexts, [s * 1e3 for s in curve], "SmolLM2 batch-1 decode step (ms) vs context",
              "context (tokens)", "ms")
    return {
        "read_bandwidth_GBps": bw, "decode_step_s": step, "decode_context": ctx,
        "roofline_s": roofline, "decode_vs_roofline": step / roofline,
        "prefix_ttft_cold_s": min(cold), "prefix_ttft_warm_s": min(warm),
        "prefix_ttft_ratio": min(warm) / min(cold),
        "decode_curve": {"contexts": contexts, "step_s": curve, "png": str(png)},
    }


def report(results: dict) -> None:
    print("\n== results (best round per system; output tokens/s, TTFT and ITL in ms)")
    for name, r in results["models"].items():
        b = r["best"]
        print(f"-- {name}")
        for k in ("A", "B", "K"):
            s = b[k]
            print(f"  {s['system']:40s} {s['tokens_per_s']:8.1f} tok/s  TTFT p50/p99 "
                  f"{s['ttft_p50_s'] * 1e3:8.0f}/{s['ttft_p99_s'] * 1e3:8.0f}  ITL p50/p99 "
                  f"{s['itl_p50_s'] * 1e3:6.1f}/{s['itl_p99_s'] * 1e3:6.1f}  "
                  f"rounds: {', '.join(f'{x:.1f}' for x in r['spread_tokens_per_s'][k])}")
        tb, ta = TARGETS[name]
        ag = r["agreement_with_A"]
        print(f"  speedup {r['speedup_vs_B']:.2f}x B (target >= {tb}), {r['speedup_vs_A']:.2f}x A "
              f"(target >= {ta}); identical to A: {ag['identical']}/{ag['of']}, "
              f"near-ties: {[d for d in ag['differences'] if d['near_tie']]}, "
              f"real differences: {[d for d in ag['differences'] if not d['near_tie']]}")
        if "kv_waste" in b["K"]:
            print(f"  KV-pool waste (watermark): {b['K']['kv_waste'] * 100:.2f} % (target <= 4 %)")
    s = results.get("single")
    if s:
        print(f"-- SmolLM2 alone: read bandwidth {s['read_bandwidth_GBps']:.1f} GB/s; batch-1 decode "
              f"{s['decode_step_s'] * 1e3:.1f} ms vs roofline {s['roofline_s'] * 1e3:.1f} ms = "
              f"{s['decode_vs_roofline']:.2f}x (target <= 1.7)")
        print(f"   TTFT with 1,024 cached prefix tokens {s['prefix_ttft_warm_s'] * 1e3:.0f} ms / cold "
              f"{s['prefix_ttft_cold_s'] * 1e3:.0f} ms = {s['prefix_ttft_ratio']:.3f} (target <= 0.12)")
        cur = s["decode_curve"]
        print("   decode step vs context: " + ", ".join(
            f"{c}: {t * 1e3:.1f} ms" for c, t in zip(cur["contexts"], cur["step_s"])) + f" ({cur['png']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small smoke run (~2 min), 1 round")
    p.add_argument("--rounds", type=int, default=None, help="rounds per model (default 3; 1 with --quick)")
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=RESULTS / "engine")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rounds = a.rounds or (1 if a.quick else 3)
    a.out.mkdir(parents=True, exist_ok=True)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=a.max_num_batched_tokens)
    t0 = time.time()
    results: dict = {"models": {}, "threads": a.threads, "rounds": rounds, "quick": a.quick,
                     "loadavg_before": os.getloadavg()}
    for name in a.models.split(","):
        if name == "tiny":
            model_dir, reqs = tiny_llama_dir(), workload(16 if a.quick else 64, (16, 512), (8, 256), 1)
        elif name == "smollm2":
            model_dir, reqs = prepare_model(progress=False), workload(6 if a.quick else 32, (16, 512), (8, 128), 2)
        else:
            p.error(f"unknown model {name!r}")
        r = bench_model(name, model_dir, reqs, rounds, config)
        factory = r.pop("_factory")
        results["models"][name] = r
        if name == "smollm2":
            results["single"] = single_request_checks(factory, a.quick, a.out)
    results["seconds"] = time.time() - t0
    results["loadavg_after"] = os.getloadavg()
    report(results)
    (a.out / "engine_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\n{results['seconds']:.0f} s; JSON in {a.out / 'engine_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
