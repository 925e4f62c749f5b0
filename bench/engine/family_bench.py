"""Decode cost per token of each native family vs the Llama of the same shape.

    .venv/bin/python -m bench family [--quick] [--rounds N] [--batch B ...] [--families ...]

Seeded random checkpoints of one shape (hidden 256, 4 layers, 8 query / 4 KV heads of 32,
MLP 1024, vocab 32000; built once into the kvfleet cache), fp32, the model runner alone (paged
KV, no scheduler): B sequences each prefilled with ``--context`` tokens, then ``--steps`` decode
steps of all B timed. Families run interleaved within each round (the order alternates), so a
ratio compares A and B measured together on the same host: the lower decile of single decode
steps (the cost with the least interference from other processes) and the median over rounds
of each round's ratio.
The figure of merit is Qwen3 ÷ Llama: qk-norm is one more norm call over (T, heads, head_dim)
per layer, not a loop over heads or tokens. Gemma 3 and Phi-3 are listed for information
(they do more per layer by design: four norms, GeGLU; partial rotary). Results go to
``bench/results/family.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common.result_file import write_json
from bench.common.seeded import seeded_model_dir
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner.model_runner import ModelRunner

SHAPE = dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, intermediate_size=1024,
             max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)
# family name → (transformers family, shape changes the family needs to load as itself)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama", {}),
    "qwen3": ("Qwen3", {}),
    "gemma3": ("Gemma3Text", {"sliding_window": 512, "query_pre_attn_scalar": 32,
                              "pad_token_id": 0}),
    "phi3": ("Phi3", {"partial_rotary_factor": 0.75, "pad_token_id": 0}),
}
BLOCK = 16


def _plans(batch: int, context: int, steps: int) -> tuple[StepPlan, list[StepPlan]]:
    """One prefill plan of ``batch`` sequences of ``context`` tokens, then ``steps`` decodes."""
    per_seq = -(-(context + steps) // BLOCK)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    tokens = [[(31 * i + 7 * p) % 32000 for p in range(context)] for i in range(batch)]
    prefill = StepPlan(tuple(SeqChunk(f"s{i}", tuple(tokens[i]), 0, tables[i]) for i in range(batch)))
    decodes = [StepPlan(tuple(SeqChunk(f"s{i}", (11 + n,), context + n, tables[i])
                              for i in range(batch))) for n in range(steps)]
    return prefill, decodes


# wall: the cost a request sees; cpu: this process's CPU seconds, which time spent waiting for
# a core on a shared host does not inflate (the same for both families, so the ratio holds).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _per_token_s(runner: ModelRunner, batch: int, context: int, steps: int, clock
                 ) -> list[float]:
    """Seconds per token of each timed decode step (the first, warming, is not timed)."""
    prefill, decodes = _plans(batch, context, steps)
    runner.execute(prefill)
    runner.execute(decodes[0])  # warm: first decode allocations
    out = []
    for plan in decodes[1:]:
        start = clock()
        runner.execute(plan)
        out.append((clock() - start) / batch)
    return out


def add_timing_args(p: argparse.ArgumentParser) -> None:
    """The flags every per-token decode bench of this kind takes (rounds, steps, context,
    batch sizes, threads, clock, --quick)."""
    p.add_argument("--quick", action="store_true", help="2 rounds of 16 steps (a smoke run)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per round")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=list(CLOCKS), default="wall",
                   help="wall (default) or cpu: CPU seconds of this process, for a shared host")


def parse_timing_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments, with ``--quick`` applied and torch's thread count set."""
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 16
    torch.set_num_threads(args.threads)
    return args


def num_blocks(args: argparse.Namespace) -> int:
    """KV blocks a runner needs for the largest batch of ``args``."""
    return max(args.batch) * -(-(args.context + args.steps) // BLOCK)


def timed_rounds(runners: dict[str, ModelRunner], args: argparse.Namespace
                 ) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, list[float]]],
                            list[float]]:
    """Decode per-token seconds of every runner, rounds interleaved (order reversed every
    other round so neither side always runs second). Returns ``(mean per round, every step,
    load average before and after)``, the first two keyed by batch size then runner name."""
    names = list(runners)
    seconds: dict[int, dict[str, list[float]]] = {b: {n: [] for n in names} for b in args.batch}
    steps: dict[int, dict[str, list[float]]] = {b: {n: [] for n in names} for b in args.batch}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for batch in args.batch:
            for name in order:
                step_s = _per_token_s(runners[name], batch, args.context, args.steps,
                                      CLOCKS[args.clock])
                seconds[batch][name].append(statistics.mean(step_s))
                steps[batch][name] += step_s
    load.append(os.getloadavg()[0])
    return seconds, steps, load


def report_vs_base(seconds: dict[int, dict[str, list[float]]],
                   steps: dict[int, dict[str, list[float]]], load: list[float],
                   args: argparse.Namespace, base: str, extra: dict, note: str,
                   out_name: str) -> dict:
    """Print and write (``bench/results/OUT_NAME``) :func:`timed_rounds`' results as ratios to
    runner ``base``: per batch size, each runner's lower-decile step per token (ms) and its
    ratio, and the median over rounds of each round's ratio. ``extra`` joins the JSON record
    after the context length (the model shape, ...); ``note`` is put in each printed line after
    the clock. Returns the record.
    """
    # Each round's ratio pairs measurements taken back to back; the median of those is what
    # a noisy host disturbs least. The lower decile of single steps (the cost with the least
    # interference) is given too.
    ratios = {b: {n: statistics.median(x / y for x, y in zip(v[n], v[base], strict=True))
                  for n in v} for b, v in seconds.items()}
    decile = {b: {n: statistics.quantiles(s, n=10)[0] for n, s in v.items()}
              for b, v in steps.items()}
    record = {"load_average_1m": load, "threads": args.threads, "clock": args.clock,
              "rounds": args.rounds, "steps": args.steps, "context": args.context, **extra,
              "lower_decile_step_per_token_ms": {b: {n: 1e3 * s for n, s in v.items()}
                                                 for b, v in decile.items()},
              f"lower_decile_ratio_vs_{base}": {b: {n: s / v[base] for n, s in v.items()}
                                               for b, v in decile.items()},
              f"median_round_ratio_vs_{base}": ratios}
    for b, v in ratios.items():
        cells = ", ".join(f"{n} {1e3 * decile[b][n]:.3f} ms ({decile[b][n] / decile[b][base]:.3f}x"
                          f", rounds {x:.3f}x)" for n, x in v.items())
        print(f"batch {b}: per-token decode ({args.clock}),{note} lower-decile step (ratio; "
              f"median paired round ratio): {cells}")
    print(f"host load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f}")
    write_json(out_name, record)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench family", description=__doc__.split("\n")[0])
    add_timing_args(p)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parse_timing_args(p, argv)
    families = ["llama", *(f for f in args.families if f != "llama")]
    runners = {}
    for name in families:
        cls, extra = FAMILIES[name]
        d = seeded_model_dir(f"family-{name}", cls, {**SHAPE, **extra}, seed=0)
        runners[name] = ModelRunner(d, num_blocks=num_blocks(args), block_size=BLOCK)
    seconds, steps, load = timed_rounds(runners, args)
    report_vs_base(seconds, steps, load, args, "llama", {"shape": SHAPE}, "", "family.json")
    return 0
