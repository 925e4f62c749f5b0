"""kvfleet's side of the engine benchmark: the real Engine (scheduler, paged KV cache, sampler,
detokenizer) over the real ModelRunner, plus the single-request measurements (roofline,
prefix reuse, decode latency against context)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Callable

import tokenizers
import torch

from bench.engine.engine_baselines import RunResult
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.step_cost.model import StepCost

BLOCK_SIZE = 16
_ids = itertools.count()


class EngineFactory:
    """One loaded model; a fresh engine (empty KV pool and prefix cache) per run."""

    def __init__(self, model_dir: Path, num_blocks: int, config: SchedulerConfig) -> None:
        self.runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=BLOCK_SIZE)
        self.tokenizer = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.config = config

    def engine(self, config: SchedulerConfig | None = None, step_cost: StepCost | None = None) -> Engine:
        c = self.runner.config
        kv = KVCacheManager(self.runner.num_blocks, BLOCK_SIZE)
        return Engine(LocalExecutor(self.runner), kv, self.tokenizer, b"bench", c.eos_token_ids,
                      c.max_position_embeddings, c.vocab_size, config or self.config,
                      step_cost=step_cost)


def _request(prompt: list[int], max_tokens: int) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True).validate()  # greedy
    return EngineRequest(f"bench{next(_ids)}", tuple(prompt), params)


def run_engine(factory: EngineFactory, requests: list[tuple[list[int], int]],
               config: SchedulerConfig | None = None, step_cost: StepCost | None = None,
               on_step: Callable[[float], None] | None = None) -> RunResult:
    """All requests submitted at t=0; step until done. Also measures KV-pool waste: after every
    step, (slots in blocks held by live requests - tokens with KV) summed over steps, ÷ slots.
    ``config`` / ``step_cost``: the engine's (default: the factory's config). ``on_step``: if
    given, called with each ``engine.step()`` call's wall seconds."""
    engine = factory.engine(config, step_cost)
    config = config or factory.config
    t0 = time.perf_counter()
    reqs = [_request(p, n) for p, n in requests]
    index = {r.request_id: i for i, r in enumerate(reqs)}
    for r in reqs:
        engine.add_request(r)
    tokens: list[list[int]] = [[] for _ in reqs]
    stamps: list[list[float]] = [[] for _ in reqs]
    reserved = live = 0
    kv = engine.kv
    while engine.has_work:
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if on_step is not None:
            on_step(now - before)
        for o in outputs:
            i = index[o.request_id]
            tokens[i] += o.token_ids
            stamps[i] += [now] * len(o.token_ids)
        reserved += (kv.num_total_blocks - kv.num_free_blocks) * kv.block_size
        live += sum(s.num_computed_tokens for s in engine.scheduler.running)
    wall = time.perf_counter() - t0
    itl = [b - a for s in stamps for a, b in zip(s, s[1:])]
    return RunResult("kvfleet engine", wall, tokens, [s[0] - t0 for s in stamps], itl,
                     extra={"kv_waste": 1 - live / reserved if reserved else 0.0,
                            "max_num_seqs": config.max_num_seqs,
                            "max_num_batched_tokens": config.max_num_batched_tokens,
                            "itl_target_ms": config.itl_target_ms})


def ttft_alone(factory: EngineFactory, engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token of one request on an idle engine, and the
    prompt tokens it found cached."""
    req = _request(prompt, 1)
    t0 = time.perf_counter()
    engine.add_request(req)
    while engine.has_work:
        for o in engine.step():
            if o.finished:
                return time.perf_counter() - t0, o.usage.cached_prompt_tokens
    raise AssertionError("no output")


def decode_step_s(factory: EngineFactory, prompt: list[int], steps: int) -> float:
    """Median seconds per decode step of one request alone (its inter-token latency)."""
    engine = factory.engine()
    engine.add_request(_request(prompt, steps + 1))
    stamps = []
    while engine.has_work:
        if engine.step():
            stamps.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return gaps[len(gaps) // 2]


def decode_latency_curve(runner: ModelRunner, contexts: list[int], repeats: int = 5) -> list[float]:
    """Batch-1 decode step seconds (best of ``repeats``) at each context length: one sequence
    is prefilled chunk by chunk up to each length, then a one-token step is timed there."""
    table = tuple(range(-(-(max(contexts) + 1) // BLOCK_SIZE)))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 10_000, (max(contexts) + 1,), generator=gen).tolist()
    done, out = 0, []
    for ctx in contexts:
        while done < ctx:
            n = min(512, ctx - done)
            runner.execute(StepPlan((SeqChunk("curve", tuple(tokens[done:done + n]), done, table),)))
            done += n
        plan = StepPlan((SeqChunk("curve", (tokens[ctx],), ctx, table),))
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            runner.execute(plan)
            best = min(best, time.perf_counter() - t)
        out.append(best)
    return out


def weight_bytes_per_decode(runner: ModelRunner) -> int:
    """Bytes of weights one decode step reads (see the model's ``weight_bytes_per_decode``)."""
    return runner.model.weight_bytes_per_decode()


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """GB/s reading (summing) a 1 GiB fp32 tensor, best of ``repeats``."""
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9
