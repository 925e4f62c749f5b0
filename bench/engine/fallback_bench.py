"""Decode cost per token of the transformers fallback ÷ the native engine, on one Llama.

    .venv/bin/python -m bench fallback [--quick] [--rounds N] [--batch B ...] [--clock cpu]

The same seeded Llama checkpoint (family_bench's shape: hidden 256, 4 layers, 8 query / 4 KV
heads of 32, MLP 1024, vocab 32000), fp32, the model runner alone (paged KV, no scheduler),
built twice: ``--model-impl native`` and ``--model-impl transformers`` (the Hugging Face class
calling the same paged attention). B sequences are prefilled with ``--context`` tokens, then
``--steps`` decode steps of all B are timed; the two run interleaved within each round (the
order alternates). Reported: the lower decile of single steps per token and the median of
each round's paired ratio. What the ratio measures: the class's per-module dispatch and its
plain ``nn.Linear`` (the native path packs weights for the CPU's GEMM library, keeps a one-row
copy for batch-1 decode and fuses Q/K/V and gate/up) — the attention is the same code. Results
go to ``bench/results/fallback.json``.
"""

from __future__ import annotations

import argparse
import statistics

from bench.common.result_file import write_json
from bench.common.seeded import seeded_model_dir
from bench.engine.family_bench import (
    BLOCK,
    SHAPE,
    add_timing_args,
    num_blocks,
    parse_timing_args,
    timed_rounds,
)
from kvfleet.worker.runner.model_runner import ModelRunner

IMPLS = ("native", "transformers")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench fallback", description=__doc__.split("\n")[0])
    add_timing_args(p)
    args = parse_timing_args(p, argv)
    d = seeded_model_dir("family-llama", "Llama", SHAPE, seed=0)
    runners = {impl: ModelRunner(d, num_blocks=num_blocks(args), block_size=BLOCK, model_impl=impl)
               for impl in IMPLS}
    assert runners["transformers"].config.impl == "transformers"
    seconds, steps, load = timed_rounds(runners, args)
    ratios = {b: statistics.median(f / n for f, n in zip(v["transformers"], v["native"], strict=True))
              for b, v in seconds.items()}
    decile = {b: {i: statistics.quantiles(s, n=10)[0] for i, s in v.items()}
              for b, v in steps.items()}
    record = {"load_average_1m": load, "threads": args.threads, "clock": args.clock,
              "rounds": args.rounds, "steps": args.steps, "context": args.context,
              "shape": SHAPE,
              "lower_decile_step_per_token_ms": {b: {i: 1e3 * s for i, s in v.items()}
                                                 for b, v in decile.items()},
              "lower_decile_ratio": {b: v["transformers"] / v["native"] for b, v in decile.items()},
              "median_round_ratio": ratios}
    for b, x in ratios.items():
        n, f = decile[b]["native"], decile[b]["transformers"]
        print(f"batch {b}: per-token decode ({args.clock}), lower-decile step: native "
              f"{1e3 * n:.3f} ms, transformers {1e3 * f:.3f} ms ({f / n:.2f}x; median paired "
              f"round ratio {x:.2f}x)")
    print(f"host load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f}")
    write_json("fallback.json", record)
    return 0
