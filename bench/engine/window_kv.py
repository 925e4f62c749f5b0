"""Window-sized KV: concurrent 8k-token sequences a KV budget holds, layer groups vs none.

    .venv/bin/python -m bench window_kv [--prompt 8192] [--window 512] [--admission reserve]
                                        [--quick] [--out FILE]

A seeded tiny Gemma 3 shape (five sliding layers of window ``--window`` per full layer, six
layers, fp32, CPU) served two ways from the same ``--kv-memory`` bytes: *before*, one group of
every layer keeping every block (the layout without layer groups); *after*, layer groups whose
sliding layers release the blocks behind their window. For each:

- reported capacity: the pool's requests of ``prompt + max_tokens`` tokens held at once
  (:meth:`KVCacheManager.capacity`, the same arithmetic as ``kvfleet budget``'s
  ``max_concurrent_requests``); under ``--admission reserve`` also what the policy promises
  each sequence (its chunks: ``reserve_capacity``) and what it would promise with chunks as
  wide as the token budget (``reserve_capacity_full_chunks``);
- an actual run: ``capacity + 1`` requests arrive at once (watermark 0, ``max_tokens`` long
  enough that the first is still decoding when the last has prefilled); the most sequences
  decoding at once with their whole prompt computed;
- decode tok/s at equal batch: ``--batch`` sequences prefilled, then decode-only steps timed.

Targets: after ÷ before ≥ 4 in capacity and in the run; decode tok/s after ÷ before ≥ 0.95.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import tokenizers
import torch

from bench.common.result_file import write_json
from bench.common.seeded import seeded_model_dir
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.config import SchedulerConfig
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.runner.kv_cache import kv_bytes_per_block, num_blocks_for_memory
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.runner.model_runner import ModelRunner

BLOCK = 16


def _model(window: int, context: int) -> Path:
    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                 query_pre_attn_scalar=32, sliding_window=window, sliding_window_pattern=6,
                 max_position_embeddings=context, bos_token_id=2, eos_token_id=1,
                 pad_token_id=0, initializer_range=0.1)
    return seeded_model_dir(f"window-kv-gemma3-w{window}-c{context}", "Gemma3Text", shape)


def _engine(model_dir: Path, groups: LayerGroups, kv_memory: int,
            sched: SchedulerConfig) -> Engine:
    cfg = load_model_config(model_dir)
    blocks = num_blocks_for_memory(cfg, BLOCK, torch.float32, kv_memory, groups=groups)
    runner = ModelRunner(model_dir, blocks, BLOCK, layer_groups=groups)
    kv = KVCacheManager(blocks, BLOCK, windows=groups.windows)
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return Engine(LocalExecutor(runner), kv, tok, b"bench-window-kv", cfg.eos_token_ids,
                  cfg.max_position_embeddings, cfg.vocab_size, sched)


def _requests(n: int, prompt: int, max_tokens: int, tag: str) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True).validate()
    return [EngineRequest(f"{tag}{i}", tuple(torch.randint(3, 49152, (prompt,), generator=g).tolist()),
                          params) for i in range(n)]


def _run(engine: Engine, reqs: list[EngineRequest], prompt: int) -> dict:
    """All ``reqs`` at once, until each has had its prompt computed: the most decoding at
    once (prompt computed) and the preemptions seen."""
    for r in reqs:
        engine.add_request(r)
    peak = preemptions = steps = 0
    prefilled: set[str] = set()
    while engine.has_work and len(prefilled) < len(reqs):
        engine.step()
        steps += 1
        running = engine.scheduler.running
        decoding = [s for s in running if s.num_computed_tokens >= prompt]
        prefilled.update(s.seq_id for s in decoding)
        peak = max(peak, len(decoding))
        preemptions = max(preemptions, sum(s.num_preemptions for s in running))
    return {"requests": len(reqs), "peak_decoding": peak, "steps": steps,
            "preemptions": preemptions}


def _decode_rate(engine: Engine, batch: int, prompt: int, decode_tokens: int) -> float:
    """Tokens per second of decode-only steps with ``batch`` sequences."""
    for r in _requests(batch, prompt, decode_tokens, "d"):
        engine.add_request(r)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in
              engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    tokens, seconds = 0, 0.0
    while engine.has_work:
        n = len(engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        seconds += time.perf_counter() - t0
        tokens += n
    return tokens / seconds


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench window_kv", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--before-seqs", type=int, default=2,
                   help="size --kv-memory to hold this many sequences without layer groups")
    p.add_argument("--batch", type=int, default=2, help="decode batch for the tok/s ratio")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int,
                   help="per request (default: 12 prefill chunks' worth of steps per prompt)")
    p.add_argument("--admission", choices=("watermark", "reserve"), default="watermark")
    p.add_argument("--quick", action="store_true", help="2,048-token prompts, window 128")
    p.add_argument("--out", default="window_kv.json")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.window = 2048, 128
    torch.set_num_threads(2)
    sched = SchedulerConfig(max_num_seqs=256, watermark=0.0, policy=args.admission)
    chunks = -(-args.prompt // sched.max_num_batched_tokens)
    max_tokens = args.max_tokens or 12 * chunks
    total = args.prompt + max_tokens
    model_dir = _model(args.window, max(2 * total, 4096))
    cfg = load_model_config(model_dir)
    layouts = {"before": LayerGroups.single(cfg.num_layers),
               "after": LayerGroups.from_windows(cfg.sliding_windows)}
    # --kv-memory: what the layout without groups needs for --before-seqs sequences, + 1 block
    per_block = kv_bytes_per_block(cfg, BLOCK, torch.float32)
    kv_memory = (args.before_seqs * (-(-total // BLOCK)) + 1) * per_block
    record: dict = {"prompt": args.prompt, "max_tokens": max_tokens, "window": args.window,
                    "kv_memory_bytes": kv_memory, "admission": args.admission,
                    "max_num_batched_tokens": sched.max_num_batched_tokens}
    for name, groups in layouts.items():
        engine = _engine(model_dir, groups, kv_memory, sched)
        record[name] = {"groups": groups.num_groups, "pages": engine.kv.num_total_blocks,
                        "capacity": engine.kv.capacity(total)}
        if args.admission == "reserve":
            blocks = engine.scheduler.blocks
            record[name].update(
                chunk=blocks.max_chunk(),
                reserve_capacity=engine.kv.capacity(total, blocks.max_chunk()),
                reserve_capacity_full_chunks=engine.kv.capacity(total,
                                                                sched.max_num_batched_tokens))
        print(name, record[name], flush=True)
    for name, groups in layouts.items():
        engine = _engine(model_dir, groups, kv_memory, sched)
        n = record[name]["capacity"] + 1
        record[name]["run"] = _run(engine, _requests(n, args.prompt, max_tokens, name), args.prompt)
        print(name, record[name]["run"], flush=True)
    for name, groups in layouts.items():
        engine = _engine(model_dir, groups, 4 * kv_memory, sched)
        record[name]["decode_tok_s"] = _decode_rate(engine, args.batch, args.prompt,
                                                    args.decode_tokens)
        print(name, "decode tok/s", round(record[name]["decode_tok_s"], 1), flush=True)
    b, a = record["before"], record["after"]
    record["ratios"] = {"capacity": a["capacity"] / b["capacity"],
                        "run_peak": a["run"]["peak_decoding"] / b["run"]["peak_decoding"],
                        "decode_tok_s": a["decode_tok_s"] / b["decode_tok_s"]}
    if args.admission == "reserve":
        for key in ("reserve_capacity", "reserve_capacity_full_chunks"):
            record["ratios"][key] = a[key] / b[key]
    print("after / before:", {k: round(v, 2) for k, v in record["ratios"].items()})
    write_json(args.out, record)
    return 0
