"""Decode cost per token of a mixture-of-experts model: 8 vs 64 experts at the same top-2.

    .venv/bin/python -m bench moe [--quick] [--rounds N] [--batch B ...] [--experts E ...]

Seeded random Qwen3-MoE checkpoints of one shape (hidden 256, 4 layers, 8 query / 4 KV heads
of 32, vocab 32000; experts 256 wide, top 2, so every token runs the same parameters whatever
the expert count; built once into the kvfleet cache), fp32, the model runner alone (paged KV,
no scheduler): B sequences each prefilled with ``--context`` tokens, then ``--steps`` decode
steps of all B timed. Expert counts run interleaved within each round (the order alternates);
the figure of merit is the per-token cost at 64 experts ÷ at 8 — the block groups tokens by
expert and runs only the experts chosen, so it should stay near 1 at batch 1 (two experts
either way). At larger batches more distinct experts are touched at 64 (up to ``2B``, each a
smaller matmul), which the ratio shows too. Results go to ``bench/results/moe.json``.
"""

from __future__ import annotations

import argparse

from bench.common.seeded import seeded_model_dir
from bench.engine.family_bench import (
    BLOCK,
    add_timing_args,
    num_blocks,
    parse_timing_args,
    report_vs_base,
    timed_rounds,
)
from kvfleet.worker.runner.model_runner import ModelRunner

SHAPE = dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, intermediate_size=1024,
             moe_intermediate_size=256, num_experts_per_tok=2, norm_topk_prob=True,
             max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench moe", description=__doc__.split("\n")[0])
    add_timing_args(p)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    args = parse_timing_args(p, argv)
    names = [f"E{e}" for e in args.experts]
    runners = {}
    for e, name in zip(args.experts, names, strict=True):
        d = seeded_model_dir(f"moe-{name}-top2", "Qwen3Moe", {**SHAPE, "num_experts": e}, seed=0)
        runners[name] = ModelRunner(d, num_blocks=num_blocks(args), block_size=BLOCK)
    seconds, steps, load = timed_rounds(runners, args)
    report_vs_base(seconds, steps, load, args, names[0],
                   {"shape": SHAPE, "experts": args.experts}, " top-2,", "moe.json")
    return 0
