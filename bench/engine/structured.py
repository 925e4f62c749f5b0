"""Structured output: decode tok/s with every row JSON-schema constrained vs free; compile time.

``python -m bench structured [--model-dir DIR] [--batch 16] [--tokens 48] [--schemas 40]
[--out FILE.json]``: the real Engine over the real ModelRunner (SmolLM2 by default).

1. Decode throughput: ``--batch`` requests, same prompts, greedy, once free and once each
   constrained by one JSON schema; tok/s over the steps where every row decodes (prefill
   excluded), and the ratio constrained / free. The schema needs >= 20 array items, so no
   constrained row can finish before --tokens: both batches stay full.
2. Compile: ``--schemas`` distinct schemas compiled cold (p50 / p99 seconds), then 10× as many
   requests drawing schemas with a Zipf(1.1) law through the cache (hit rate).
3. TTFT: one request with a schema never seen vs one whose schema is cached (median of 5),
   compile included (what the service does before submitting).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path

import tokenizers

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.constraint import Constraint
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.runner.model_runner import ModelRunner

BLOCK_SIZE = 16
_ids = itertools.count()
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "minItems": 20, "items": {
              "type": "object", "additionalProperties": False, "required": ["name", "qty"],
              "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}}}}}}
PROMPTS = ["List the groceries for a week as JSON.", "Describe your shopping cart as JSON.",
           "What do I need to bake bread? Answer in JSON.", "Inventory of a small shop, as JSON."]


def variant(i: int) -> Constraint:
    """A distinct schema per ``i`` (property names and an enum differ)."""
    schema = {"type": "object", "additionalProperties": False, "required": [f"f{i}", "kind"],
              "properties": {f"f{i}": {"type": "string", "maxLength": 8 + i % 16},
                             "kind": {"enum": [f"k{i}_{j}" for j in range(1 + i % 5)]},
                             "tags": {"type": "array", "items": {"type": "integer"},
                                      "maxItems": 1 + i % 4}}}
    return Constraint("json_schema", json.dumps(schema), "json_schema")


def _engine(runner: ModelRunner, tok, batch: int) -> Engine:
    c = runner.config
    return Engine(runner, KVCacheManager(runner.num_blocks, BLOCK_SIZE), tok, b"bench",
                  c.eos_token_ids, c.max_position_embeddings, c.vocab_size,
                  SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048))


def _prompt(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids


def decode_rate(engine: Engine, prompts: list[list[int]], tokens: int,
                constraint: Constraint | None) -> tuple[float, int]:
    """(tok/s over all-decode steps, tokens counted)."""
    for p in prompts:
        params = SamplingParams(max_tokens=tokens, ignore_eos=constraint is None).validate()
        engine.add_request(EngineRequest(f"b{next(_ids)}", tuple(p), params,
                                         constraint=constraint))
    decode_s, counted = 0.0, 0
    while engine.has_work:
        decoding = all(s.num_computed_tokens >= s.num_prompt_tokens
                       for s in engine.scheduler.running) and not engine.scheduler.waiting
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            decode_s += time.perf_counter() - t
            counted += sum(len(o.token_ids) for o in outs)
    return counted / decode_s, counted


def main(argv: list[str]) -> int:
    from kvfleet.deploy.models import prepare_model

    ap = argparse.ArgumentParser(prog="python -m bench structured", description=__doc__)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--schemas", type=int, default=40)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    model_dir = args.model_dir or prepare_model(progress=False)
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    runner = ModelRunner(model_dir, num_blocks=args.batch * 8, block_size=BLOCK_SIZE)
    prompts = [_prompt(tok, PROMPTS[i % len(PROMPTS)] + f" (#{i})") for i in range(args.batch)]
    engine = _engine(runner, tok, args.batch)
    schema = Constraint("json_schema", json.dumps(SCHEMA), "json_schema")
    engine.grammars.compile(schema)  # the import and tokenizer tables: not a per-step cost
    decode_rate(engine, prompts, 4, None)  # warm-up: kernel build, allocator, caches
    free, n_free = decode_rate(engine, prompts, args.tokens, None)
    masked, n_masked = decode_rate(engine, prompts, args.tokens, schema)
    free2, _ = decode_rate(engine, prompts, args.tokens, None)  # drift check on a shared CPU
    result: dict = {"batch": args.batch, "free_tok_s": free, "free_again_tok_s": free2,
                    "constrained_tok_s": masked, "ratio": masked / ((free + free2) / 2),
                    "tokens": {"free": n_free, "constrained": n_masked}}
    cache = engine.grammars
    cold = []
    for i in range(args.schemas):
        t = time.perf_counter()
        cache.compile(variant(1000 + i))
        cold.append(time.perf_counter() - t)
    cold.sort()
    result["compile_s"] = {"p50": statistics.median(cold),
                           "p99": cold[min(len(cold) - 1, int(0.99 * len(cold)))],
                           "n": len(cold)}
    rng = random.Random(0)
    weights = [1 / (k + 1) ** 1.1 for k in range(args.schemas)]
    hits0, miss0 = cache.stats.hits, cache.stats.misses
    for k in rng.choices(range(args.schemas), weights, k=10 * args.schemas):
        cache.compile(variant(2000 + k))
    hits, misses = cache.stats.hits - hits0, cache.stats.misses - miss0
    result["cache"] = {"requests": hits + misses, "hits": hits, "hit_rate": hits / (hits + misses)}
    result["ttft_s"] = {"new_schema": _ttft(engine, prompts[0], [variant(3000 + i) for i in range(5)]),
                        "cached_schema": _ttft(engine, prompts[0], [variant(3000)] * 5)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ratio"] > 0 else 1


def _ttft(engine: Engine, prompt: list[int], constraints: list[Constraint]) -> float:
    """Median seconds from arrival (compile included) to the first token, one at a time."""
    times = []
    for c in constraints:
        t = time.perf_counter()
        grammar = engine.grammars.compile(c)
        params = SamplingParams(max_tokens=1).validate()
        rid = f"t{next(_ids)}"
        engine.add_request(EngineRequest(rid, tuple(prompt), params, constraint=c, grammar=grammar))
        while not any(o.token_ids for o in engine.step()):
            pass
        times.append(time.perf_counter() - t)
        while engine.has_work:
            engine.step()
    return statistics.median(times)
