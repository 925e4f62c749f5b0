"""GPU check: tp=1 logit parity against transformers and decode tokens/s against ``generate``.

    python bench/engine/gpu_check.py [--device cuda|cpu] [--out FILE.json] [--batches 1,8,32,64]

Runs from a bare source checkout (nothing installed: :mod:`bench.common.source_tree` maps the folders
onto ``kvfleet.*``) with only torch, transformers, safetensors, tokenizers, grpcio and
protobuf — no Ray, Redis or OpenTelemetry — as on the lent GPU machine. It builds a seeded
Llama with transformers (``--shape 1b``: Llama-3.2-1B's shape, 1.24 B parameters, the default
on CUDA; ``tiny`` on CPU, seconds), saves it with safetensors to a temporary directory, and:

1. **parity**: a fixed workload (4 prompts of 5-71 tokens in uneven chunks beside running
   decodes, then a request reusing 3 cached blocks of one of them) through kvfleet's engine;
   every logits row the runner returned is compared with transformers' full-prefix forward of
   the same tokens. fp32 passes when ``max |Δ| <= 1e-4 × max(1, max |ref|)`` (the suite's
   tolerance; TF32 is switched off). bf16 has no exact answer: it passes when kvfleet's bf16
   logits are within ``2 × e_hf + 1e-3 × scale`` of the fp32 reference, ``e_hf`` being
   transformers' own bf16 error against it on the same tokens (bf16's resolution, 2^-8
   relative, makes ``e_hf`` a few hundredths of the logit scale);
2. **decode tokens/s** at each batch size, prompts of ``--prompt-len`` tokens, ``--new-tokens``
   each, in ``--bench-dtype`` (bf16 on CUDA): kvfleet's engine (timed after every request has
   its first token) vs transformers ``generate`` (time for N tokens − time for 1), the device
   synchronised around every timing.

On CUDA the engine runs the torch attention path over the block tables (the C kernels are CPU
fp32 only); on CPU the script switches them off too (``--c-kernels`` keeps them), so the CPU run
exercises the code the GPU runs. Prints a table, writes JSON (``--out``); exit status 1 when a
parity check fails or a phase raises (its record then holds the error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the checkout's `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import source_tree  # noqa: E402

source_tree.install()  # before anything imports kvfleet (it need not be installed)

import torch  # noqa: E402

from bench.engine import gpu_runs  # noqa: E402

SHAPES = {
    # Llama-3.2-1B's shape (default RoPE); std 0.02 gives logits of a few units.
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.15,
                 rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_RTOL = 1e-4
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-3
BLOCK_SIZE = 16
PARITY_NEW_TOKENS = 12
_BLOCKED = ("ray", "redis", "opentelemetry")


def build_model(shape: str, device: torch.device, out: Path):
    """Seeded ``LlamaForCausalLM`` of ``shape`` in fp32 on ``device``, saved (safetensors) to
    ``out`` with a word-level ``tokenizer.json`` over its vocabulary; returns the model."""
    import tokenizers
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: 1.2 B parameters in seconds on a GPU
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES[shape]))
    model = model.to(device=device, dtype=torch.float32).eval()
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(SHAPES[shape]["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return model


def load_hf(model_dir: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model loaded as its users load it in ``dtype`` (not ``.to(dtype)`` of the
    fp32 one, which would also round the fp32 RoPE frequencies to bf16)."""
    import transformers

    for key in ("dtype", "torch_dtype"):  # transformers >= 4.56 / older
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, **{key: dtype})
        if next(model.parameters()).dtype == dtype:
            return model.to(device).eval()
    raise RuntimeError(f"transformers {transformers.__version__} did not load {dtype}")


def check_parity(dtype_name: str, runner, tokenizer, hf: dict, device: torch.device) -> dict:
    """Parity of one engine dtype; ``hf`` maps "fp32" (and "bf16" for a bf16 check) to
    transformers models. Returns the JSON record, ``passed`` included."""
    traces = gpu_runs.parity_traces(runner, tokenizer, PARITY_NEW_TOKENS)
    cmp = gpu_runs.compare(traces, hf, device)
    ref = cmp["fp32"]
    rec = {"dtype": dtype_name, "requests": len(traces), "rows": ref["rows"],
           "cached_prompt_tokens": sum(t.cached_prompt_tokens for t in traces.values()),
           "max_abs_vs_hf_fp32": ref["max_abs"], "scale": ref["scale"],
           "top1_vs_hf_fp32": ref["top1"]}
    if dtype_name == "fp32":
        rec["tolerance"] = FP32_RTOL * ref["scale"]
        rec["rule"] = f"max|Δ| <= {FP32_RTOL:g} × scale"
    else:
        hf_err = cmp["bf16"]["vs_fp32"]
        rec |= {"hf_bf16_vs_hf_fp32": hf_err, "max_abs_vs_hf_bf16": cmp["bf16"]["max_abs"],
                "top1_vs_hf_bf16": cmp["bf16"]["top1"],
                "tolerance": BF16_FACTOR * hf_err + BF16_FLOOR * ref["scale"],
                "rule": f"max|Δ| <= {BF16_FACTOR:g} × HF bf16 error + {BF16_FLOOR:g} × scale"}
    rec["passed"] = rec["max_abs_vs_hf_fp32"] <= rec["tolerance"] and rec["cached_prompt_tokens"] > 0
    return rec


def make_runner(model_dir: Path, dtype: torch.dtype, device: torch.device, num_blocks: int):
    """kvfleet's runner for ``model_dir``: weights and ``num_blocks`` KV blocks on ``device``."""
    from kvfleet.worker.runner.model_runner import ModelRunner

    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype,
                       device=str(device), one_row_weights=False)


def report(r: dict) -> None:
    """Print ``r`` (the JSON result) as the summary and the two tables."""
    m = r["model"]
    print(f"\nkvfleet gpu_check: {r['device_name']} · torch {r['torch']} · transformers "
          f"{r['transformers']} · {r['seconds']:.0f} s")
    print(f"model: seeded Llama '{m['shape']}': hidden {m['hidden_size']}, {m['layers']} layers, "
          f"{m['heads']}/{m['kv_heads']} heads, vocab {m['vocab_size']}, "
          f"{m['parameters'] / 1e6:,.1f} M parameters")
    print(f"kvfleet imported from {r['imports']['kvfleet']}; "
          f"{', '.join(_BLOCKED)} loaded: {r['imports']['blocked_loaded'] or 'none'}")
    print("\nparity (engine logits vs transformers' full-prefix forward)")
    print(f"{'dtype':6} {'rows':>5} {'cached':>7} {'max|Δ| vs HF fp32':>18} {'tolerance':>10} "
          f"{'scale':>7} {'top-1':>6}  result  rule")
    for p in r["parity"]:
        if "error" in p:
            print(f"{p['dtype']:6} ERROR {p['error']}")
            continue
        print(f"{p['dtype']:6} {p['rows']:5d} {p['cached_prompt_tokens']:7d} "
              f"{p['max_abs_vs_hf_fp32']:18.3e} {p['tolerance']:10.3e} {p['scale']:7.3f} "
              f"{p['top1_vs_hf_fp32']:6.3f}  {'PASS' if p['passed'] else 'FAIL':6}  {p['rule']}"
              + (f" (HF bf16 error {p['hf_bf16_vs_hf_fp32']:.3e})" if "hf_bf16_vs_hf_fp32" in p else ""))
    d = r["decode"]
    print(f"\ndecode tokens/s ({d['dtype']}, prompt {d['prompt_len']} tokens, {d['new_tokens']} new "
          f"tokens per request; prefill excluded)")
    print(f"{'batch':>5} {'HF generate':>12} {'kvfleet':>10} {'kvfleet ÷ HF':>13} "
          f"{'HF step ms':>11} {'kvfleet step ms':>16}")
    for row in d["rows"]:
        if "error" in row:
            print(f"{row['batch']:5d} ERROR {row['error']}")
            continue
        print(f"{row['batch']:5d} {row['hf_tokens_per_s']:12.1f} {row['kvfleet_tokens_per_s']:10.1f} "
              f"{row['ratio']:12.2f}× {row['hf_step_ms']:11.2f} {row['kvfleet_step_ms']:16.2f}")


def _guarded(what: str, fn, *args) -> dict:
    """``fn(*args)``, or a failed record naming the error (one broken phase on a lent machine
    must not cost the others' numbers)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 — recorded, printed, and the exit status says so
        traceback.print_exc()
        return {"what": what, "error": f"{type(exc).__name__}: {exc}", "passed": False}


def run_parity(model_dir: Path, tokenizer, hf32, device, num_blocks: int) -> tuple[list, dict, dict]:
    """Both parity checks; returns (records, runners by dtype, transformers models by dtype)."""
    parity, runners, hf = [], {}, {"fp32": hf32}
    for name in ("fp32", "bf16"):
        if name == "bf16":
            hf["bf16"] = load_hf(model_dir, torch.bfloat16, device)
        runners[name] = runner = make_runner(model_dir, DTYPES[name], device, num_blocks)
        rec = _guarded(f"parity {name}", check_parity, name, runner, tokenizer, hf, device)
        parity.append({"dtype": name} | rec)
        print(f"parity {name}: " + (rec.get("error") or f"max|Δ| {rec['max_abs_vs_hf_fp32']:.3e} "
              f"(tolerance {rec['tolerance']:.3e}) {'PASS' if rec['passed'] else 'FAIL'}"), flush=True)
    return parity, runners, hf  # all kept: ~15 GiB in all for the 1b shape


def decode_row(runner, hf, tokenizer, device, batch: int, prompt_len: int, new_tokens: int,
               repeats: int) -> dict:
    """Decode tokens/s of kvfleet and of transformers at one batch size (the JSON row)."""
    prompts = gpu_runs.random_prompts(batch, prompt_len, runner.config.vocab_size, seed=batch)
    ours = gpu_runs.engine_decode_rate(runner, tokenizer, prompts, new_tokens, repeats)
    theirs = gpu_runs.hf_decode_rate(hf, prompts, new_tokens, device, repeats)
    print(f"decode batch {batch}: kvfleet {ours.tokens_per_s:.1f} tok/s, "
          f"HF {theirs.tokens_per_s:.1f} tok/s", flush=True)
    return {"batch": batch, "kvfleet_tokens_per_s": ours.tokens_per_s,
            "hf_tokens_per_s": theirs.tokens_per_s, "ratio": ours.tokens_per_s / theirs.tokens_per_s,
            "kvfleet_step_ms": ours.step_ms, "hf_step_ms": theirs.step_ms,
            "kvfleet_tokens": ours.tokens, "hf_tokens": theirs.tokens}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, with the per-device defaults filled in (``device`` a torch.device)."""
    p = argparse.ArgumentParser(prog="bench/engine/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 1b on CUDA, tiny on CPU")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--prompt-len", type=int, help="default 128 on CUDA, 16 on CPU")
    p.add_argument("--new-tokens", type=int, help="default 128 on CUDA, 8 on CPU")
    p.add_argument("--bench-dtype", choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (best counts)")
    p.add_argument("--c-kernels", action="store_true", help="CPU: keep kvfleet's C kernels on")
    p.add_argument("--out", type=Path, default=source_tree.ROOT / "bench" / "results" / "gpu_check.json")
    a = p.parse_args(argv)
    a.device = torch.device(a.device)
    cuda = a.device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("CUDA is not available here (use --device cpu)")
    a.shape = a.shape or ("1b" if cuda else "tiny")
    a.prompt_len = a.prompt_len or (128 if cuda else 16)
    a.new_tokens = a.new_tokens or (128 if cuda else 8)
    a.bench_dtype = a.bench_dtype or ("bf16" if cuda else "fp32")
    a.batches = [int(b) for b in a.batches.split(",")]
    return a


def main(argv: list[str] | None = None) -> int:
    """Run both checks, print the tables, write the JSON; 0 when everything passed."""
    a = parse_args(argv)
    device, cuda, cfg = a.device, a.device.type == "cuda", SHAPES[a.shape]
    if not cuda and not a.c_kernels:
        from kvfleet.worker.runner import cpu_kernels

        os.environ[cpu_kernels.ENV_SWITCH] = "torch"  # the attention code CUDA runs
        cpu_kernels.load.cache_clear()
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32: no TF32 matmuls
    t0 = time.time()
    import tokenizers
    import transformers

    import kvfleet

    with tempfile.TemporaryDirectory(prefix="kvfleet-gpu-check-") as tmp:
        model_dir = Path(tmp)
        hf32 = build_model(a.shape, device, model_dir)
        tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        # KV for the largest batch (or the parity workload), with room for a block per request.
        per_req = -(-(a.prompt_len + a.new_tokens) // BLOCK_SIZE) + 1
        num_blocks = max(max(a.batches) * per_req, 64) + 16
        parity, runners, hf = run_parity(model_dir, tokenizer, hf32, device, num_blocks)
        runner, hf_bench = runners[a.bench_dtype], hf[a.bench_dtype]
        # Warm-up (CUDA context, cuBLAS handles, allocator): neither side is timed cold.
        warm = gpu_runs.random_prompts(2, a.prompt_len, cfg["vocab_size"], seed=99)
        gpu_runs.engine_decode_rate(runner, tokenizer, warm, 4, 1)
        gpu_runs.hf_decode_rate(hf_bench, warm, 4, device, 1)
        rows = [{"batch": b} | _guarded(f"decode batch {b}", decode_row, runner, hf_bench, tokenizer,
                                        device, b, a.prompt_len, a.new_tokens, a.repeats)
                for b in a.batches]
        result = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "model": {"shape": a.shape, "hidden_size": cfg["hidden_size"],
                      "layers": cfg["num_hidden_layers"], "heads": cfg["num_attention_heads"],
                      "kv_heads": cfg["num_key_value_heads"], "vocab_size": cfg["vocab_size"],
                      "parameters": sum(t.numel() for t in hf32.parameters())},
            "imports": {"kvfleet": str(Path(kvfleet.__file__).resolve().parent.parent),
                        "blocked_loaded": sorted(m for m in _BLOCKED if m in sys.modules)},
            "parity": parity,
            "parity_passed": all(x["passed"] for x in parity),
            "decode": {"dtype": a.bench_dtype, "prompt_len": a.prompt_len,
                       "new_tokens": a.new_tokens, "repeats": a.repeats, "block_size": BLOCK_SIZE,
                       "rows": rows, "passed": not any("error" in r for r in rows)},
            "max_memory_allocated_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "seconds": time.time() - t0,
        }
    report(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nJSON in {a.out}")
    return 0 if result["parity_passed"] and result["decode"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
