"""Multi-LoRA serving: base model vs 4 adapters mixed in one batch vs merge-and-serve.

    .venv/bin/python -m bench lora [--quick] [--rounds N] [--rank R] [--out DIR]

One run, one request list (16 requests: prompts uniform in 64-256 tokens, 64 output tokens
each, greedy, EOS ignored), fp32, 2 torch threads, the in-process engine (scheduler, paged KV,
model runner; no router):

- **base**: all 16 on the base model, concurrently;
- **mixed**: the same 16 spread over 4 adapters (4 each), all concurrently in one engine: each
  step's tokens grouped by adapter (worker/runner/lora/slots.py);
- **merge**: adapter after adapter, its weights merged into the base (``W + scale * B @ A``,
  then the projections rebuilt and packed: counted), its 4 requests served as one batch.

Adapters are random PEFT-format directories (rank ``--rank``, alpha 2r, every projection),
written once under the output directory. Rounds interleave base/mixed/merge; each system's
best round counts. The first mixed round includes loading the adapters into their slots (off
the engine thread); that time is reported too. "Where the time goes": the seconds the mixed
run spends inside the LoRA updates (building the step's segments + the low-rank matmuls).
Results go to ``--out`` (default ``bench/results/lora``) as ``lora.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import load_file, save_file

from bench.common.seeded import seeded_llama_dir
from kvfleet.allocator.hashing import CacheIdentity
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.deploy.models import prepare_model
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.runner.lora import slots as lora_slots
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.lora.config import MODULES
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.models import build_model
from kvfleet.worker.runner.weights import load_weights

NUM_ADAPTERS, PER_ADAPTER, OUTPUT_TOKENS, BLOCK_SIZE = 4, 4, 64, 16
TINY = dict(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=1024, max_position_embeddings=1024,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def write_adapter(out: Path, runner: ModelRunner, rank: int, seed: int) -> Path:
    """A random PEFT LoRA over every projection (A ~ U(-1/sqrt(in), ..), B ~ N(0, 0.02))."""
    if (out / "adapter_model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    c, g = runner.config, torch.Generator().manual_seed(seed)
    dims = {"q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size),
            "v_proj": (c.hidden_size, c.kv_size), "o_proj": (c.q_size, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}
    tensors = {}
    for i in range(c.num_layers):
        for m, (sub, _, _) in MODULES.items():
            fan_in, fan_out = dims[m]
            key = f"base_model.model.model.layers.{i}.{sub}"
            tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, fan_in, generator=g) * 2 - 1) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}))
    return out


def workload(seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 256))]
            for _ in range(NUM_ADAPTERS * PER_ADAPTER)]


def serve(runner, prompts: list[list[int]], adapters: list[str], residency=None) -> int:
    """Run every prompt to OUTPUT_TOKENS in one fresh engine; returns the output tokens."""
    cfg = runner.config
    identity = CacheIdentity("bench", "w", "t", "c", "float32", BLOCK_SIZE)
    engine = Engine(runner, KVCacheManager(runner.num_blocks, BLOCK_SIZE), _TOKENIZER[0],
                    identity.digest(), cfg.eos_token_ids, cfg.max_position_embeddings,
                    cfg.vocab_size, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                    adapters=residency, identity=identity)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True).validate()
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add_request(EngineRequest(f"r{i}", tuple(p), params, adapter=a))
    tokens = 0
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens


def merged_weights(base: dict, spec) -> dict:
    """HF-named base tensors with the adapter merged: ``W += scale * B @ A`` per target."""
    lora = load_file(str(Path(spec.path) / "adapter_model.safetensors"))
    out = dict(base)
    for t in spec.config.targets:
        key = f"{t.key}.weight"
        a, b = (lora[f"base_model.model.{t.key}.lora_{w}.weight"] for w in "AB")
        out[key] = base[key] + t.scale * (b @ a)
    return out


_TOKENIZER: list = []


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the seeded tiny Llama, not SmolLM2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default="bench/results/lora")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = seeded_llama_dir("tiny-llama-h256-l4-v32000", TINY) if args.quick else prepare_model(progress=False)
    out = Path(args.out)
    _TOKENIZER.append(tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))
    runner = ModelRunner(model_dir, num_blocks=NUM_ADAPTERS * PER_ADAPTER * 24, block_size=BLOCK_SIZE,
                         one_row_weights=False, max_loras=NUM_ADAPTERS)
    base_model = runner.model
    specs = [check_adapter(f"lora{i}", write_adapter(out / "adapters" / f"{Path(model_dir).name}-r{args.rank}-{i}", runner,
                                                     args.rank, seed=i), runner.config, args.rank)
             for i in range(NUM_ADAPTERS)]
    residency = AdapterResidency(runner, {s.name: s for s in specs}, NUM_ADAPTERS)
    prompts = workload(vocab=runner.config.vocab_size)
    names = [specs[i % NUM_ADAPTERS].name for i in range(len(prompts))]
    base_weights = load_weights(model_dir, torch.float32)

    lora_s = [0.0]
    apply, build = lora_slots.LoraBatch.apply, lora_slots.LoraBatch.build.__func__

    def timed_apply(self, *a):
        t0 = time.perf_counter()
        apply(self, *a)
        lora_s[0] += time.perf_counter() - t0

    def timed_build(cls, *a):
        t0 = time.perf_counter()
        r = build(cls, *a)
        lora_s[0] += time.perf_counter() - t0
        return r

    rounds: dict[str, list[dict]] = {"base": [], "mixed": [], "merge": []}
    for k in range(args.rounds):
        t0 = time.perf_counter()
        n = serve(runner, prompts, [""] * len(prompts))
        rounds["base"].append({"s": time.perf_counter() - t0, "tokens": n})

        lora_s[0] = 0.0
        lora_slots.LoraBatch.apply, lora_slots.LoraBatch.build = timed_apply, classmethod(timed_build)
        t0 = time.perf_counter()
        n = serve(runner, prompts, names, residency)
        lora_slots.LoraBatch.apply, lora_slots.LoraBatch.build = apply, classmethod(build)
        rounds["mixed"].append({"s": time.perf_counter() - t0, "tokens": n, "lora_s": lora_s[0],
                                "includes_adapter_loads": k == 0})

        t0, merge_s, n = time.perf_counter(), 0.0, 0
        for i, spec in enumerate(specs):
            m0 = time.perf_counter()
            runner.model = build_model(runner.config, merged_weights(base_weights, spec),
                                       torch.float32, "cpu")
            merge_s += time.perf_counter() - m0
            mine = [p for j, p in enumerate(prompts) if j % NUM_ADAPTERS == i]
            n += serve(runner, mine, [""] * len(mine))
        runner.model = base_model
        rounds["merge"].append({"s": time.perf_counter() - t0, "tokens": n, "merge_s": merge_s})
        print(f"round {k}: " + ", ".join(f"{name} {r[-1]['tokens'] / r[-1]['s']:.1f} tok/s"
                                         for name, r in rounds.items()), flush=True)
    residency.close()
    best = {name: min(r, key=lambda x: x["s"]) for name, r in rounds.items()}
    tps = {name: b["tokens"] / b["s"] for name, b in best.items()}
    report = {"model": str(model_dir), "rank": args.rank, "requests": len(prompts),
              "output_tokens_per_request": OUTPUT_TOKENS, "rounds": rounds,
              "tokens_per_s": tps, "mixed_over_base": tps["mixed"] / tps["base"],
              "mixed_over_merge": tps["mixed"] / tps["merge"],
              "mixed_lora_share": best["mixed"]["lora_s"] / best["mixed"]["s"],
              "merge_share": best["merge"]["merge_s"] / best["merge"]["s"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(report, indent=2))
    print(f"output tokens/s: base {tps['base']:.1f}, mixed 4 adapters {tps['mixed']:.1f} "
          f"({report['mixed_over_base']:.2f}x base, target >= 0.7), merge-and-serve "
          f"{tps['merge']:.1f} (mixed = {report['mixed_over_merge']:.2f}x, target >= 2)")
    print(f"mixed: {100 * report['mixed_lora_share']:.0f} % of its time in LoRA updates; "
          f"merge-and-serve: {100 * report['merge_share']:.0f} % of its time merging")
    return 0
