"""Weight-only int8 / int4 against fp32 on SmolLM2: decode tok/s at batch 1 and 16 (and
llama.cpp's at Q8_0 / Q4_K_M as an optional peer), the projections' kernels against torch's
own weight-only ones, weight bytes, and perplexity on a public-domain text.

Every variant is measured in the same run, interleaved round by round; the medians and the
host load go in the record (``bench/results/quant.json``). The peer runs when
``--llama-cpp DIR`` names a llama.cpp build (``DIR/bin/llama-batched-bench``, and
``llama-quantize`` with ``--convert`` pointing at its ``convert_hf_to_gguf.py``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

import tokenizers
import torch

from bench.common.result_file import write_json
from bench.engine.quant_peer import LlamaCpp
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.deploy.models import prepare_model
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.step_plan import SeqChunk
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.runner import attention
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.models.linear import Linear
from kvfleet.worker.runner.quant import kernels
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.packed import quantize
from kvfleet.worker.runner.weights import load_weights

TEXT = Path(__file__).parent / "data" / "declaration_of_independence.txt"
BLOCK = 16
METHODS = ("none", "int8", "int4")
_ids = itertools.count()


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def decode_tok_s(runner: ModelRunner, tokenizer, batch: int, steps: int, prompt: int = 32) -> float:
    """Decode tokens per second of ``batch`` greedy requests through the real engine, timed
    over ``steps`` steps once every request is decoding."""
    config = runner.config
    engine = Engine(LocalExecutor(runner), KVCacheManager(runner.num_blocks, BLOCK), tokenizer,
                    b"bench", config.eos_token_ids, config.max_position_embeddings,
                    config.vocab_size, SchedulerConfig(max_num_seqs=batch,
                                                       max_num_batched_tokens=2048))
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True).validate()
    for i in range(batch):
        ids = tuple(range(1000 + 37 * i, 1000 + 37 * i + prompt))
        engine.add_request(EngineRequest(f"q{next(_ids)}", ids, params))
    for _ in range(3):  # prefill and the first decode
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_work:
        engine.step()
    return batch * steps / elapsed


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids`` in one forward (every position's logits)."""
    table = tuple(range(-(-len(ids) // BLOCK)))
    chunk = SeqChunk("ppl", tuple(ids), 0, table)
    meta = attention.build_attention_metadata((chunk,), BLOCK, (None,), runner.device, runner.dtype)
    with torch.inference_mode():
        hidden = runner.model.forward(torch.tensor(ids), meta.positions, meta, runner.kv_cache)
        logits = runner.model.compute_logits(hidden).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll))


def kernel_pass_ms(rows: int, rounds: int) -> dict[str, float]:
    """Median ms of one pass over SmolLM2's 120 projection shapes (30 layers), ``rows`` rows."""
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    lib = kernels.load()
    g = torch.Generator().manual_seed(0)
    mats = []
    for k, n in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        s8 = w.abs().amax(1) / 127
        q4 = quantize(w, 4, 32)
        codes, scale, offset = q4.unpack()
        zeros = (offset.float() + 8 * scale.float())  # torch's int4: (q - 8) * scale + zero
        sz = torch.stack([scale.float(), zeros], -1).transpose(0, 1).contiguous()
        mats.append({"x": torch.randn(rows, k, generator=g),
                     "fp32": Linear(w.t().contiguous(), None, one_row_copy=True),
                     "int8": quantize(w, 8, 32), "int4": q4,
                     "a8": (torch.round(w / s8[:, None]).to(torch.int8), s8),
                     "a4": (torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                         codes.to(torch.int32).contiguous(), 2), sz)})
    ops = {"fp32": lambda m: m["fp32"](m["x"]),
           "int8": lambda m: kernels.qmatmul_c(m["x"], m["int8"], None, lib),
           "int4": lambda m: kernels.qmatmul_c(m["x"], m["int4"], None, lib),
           "aten_int8": lambda m: torch.ops.aten._weight_int8pack_mm(m["x"], *m["a8"]),
           "aten_int4": lambda m: torch.ops.aten._weight_int4pack_mm_for_cpu(m["x"], m["a4"][0],
                                                                             32, m["a4"][1])}
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds + 1):
        for name, op in ops.items():
            start = time.perf_counter()
            for _ in range(30):
                for m in mats:
                    op(m)
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench quant", description=__doc__)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp build directory (the peer)")
    p.add_argument("--convert", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--skip-kernels", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model(progress=False)
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    record: dict = {"threads": args.threads, "load_at_start": _load(),
                    "cpu": torch.backends.cpu.get_cpu_capability()}
    if not args.skip_kernels:
        record["kernel_pass_ms"] = {f"batch_{rows}": kernel_pass_ms(rows, args.rounds)
                                    for rows in (1, 16)}
        print("kernels:", record["kernel_pass_ms"], "load", _load(), flush=True)
    runners = {m: ModelRunner(model_dir, num_blocks=200, block_size=BLOCK,
                              quantization=QuantConfig(m)) for m in METHODS}
    fp32_params = 4 * sum(t.numel() for t in load_weights(model_dir).values())  # the checkpoint
    record["weight_bytes"] = {m: r.weight_nbytes() for m, r in runners.items()}
    record["fp32_parameter_bytes"] = fp32_params
    ids = tokenizer.encode(TEXT.read_text()).ids
    record["perplexity"] = {m: round(perplexity(r, ids), 4) for m, r in runners.items()}
    record["perplexity_tokens"] = len(ids)
    print("weights:", record["weight_bytes"], "ppl:", record["perplexity"], flush=True)
    peer = LlamaCpp.find(args.llama_cpp, args.convert, model_dir) if args.llama_cpp else None
    samples: dict[str, list[float]] = {}
    loads = []
    for _ in range(args.rounds):
        for m, runner in runners.items():
            for batch in (1, 16):
                samples.setdefault(f"{m}_b{batch}", []).append(
                    decode_tok_s(runner, tokenizer, batch, args.steps))
        if peer is not None:
            for quant, tok_s in peer.decode_tok_s(args.threads, args.steps).items():
                samples.setdefault(quant, []).append(tok_s)
        loads.append(_load())
        print({k: round(v[-1], 1) for k, v in samples.items()}, "load", loads[-1], flush=True)
    record["decode_tok_s"] = {k: round(statistics.median(v), 1) for k, v in samples.items()}
    record["load_per_round"] = loads
    write_json("quant.json", record)
    return 0
