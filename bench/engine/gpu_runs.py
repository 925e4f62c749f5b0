"""The measurements of ``bench/engine/gpu_check.py``: logit parity of the real engine against
transformers, and decode tokens/s of both, on one device.

Everything here goes through kvfleet's :class:`Engine` (scheduler, KV cache manager with
prefix caching, sampler, detokenizer) over its :class:`ModelRunner`; the only addition is a
wrapper that keeps each chunk's last-token logits as the runner returns them. Import this
module only after :func:`bench.common.source_tree.install` (``kvfleet`` may not be installed).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

import tokenizers
import torch

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.runner.model_runner import ModelRunner

_ids = itertools.count()
# Parity workload: prompt lengths (block size 16: partial, mid-block and multi-block prompts),
# then one request sharing the 71-token prompt's first 48 tokens (3 cached blocks) + 9 new.
PARITY_PROMPT_LENS = (5, 23, 40, 71)
SHARED_PREFIX, SHARED_SUFFIX = 48, 9
# A token budget this small splits the prompts into uneven chunks next to running decodes.
PARITY_CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings must not stop at a kernel launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RecordingExecutor:
    """The engine's runner, unchanged, keeping every returned logits row by request and
    absolute position: ``rows[request_id][p]`` = float32 ``(vocab,)`` logits after token ``p``."""

    pausable = False  # whole steps only: no execute_pausable

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """:meth:`ModelRunner.execute`, keeping the rows it returns."""
        logits = self.runner.execute(plan)
        for chunk, row in zip(plan.chunks, logits, strict=True):
            request_id = chunk.seq_id.rsplit("#", 1)[0]  # seq id "<request>#<sample>"
            last = chunk.num_computed_tokens + len(chunk.token_ids) - 1
            self.rows.setdefault(request_id, {})[last] = row
        return logits


def make_engine(runner, model_runner: ModelRunner, tokenizer: tokenizers.Tokenizer,
                config: SchedulerConfig) -> Engine:
    """A fresh engine (empty KV pool and prefix cache) over ``runner`` (the model runner or a
    wrapper of it) and ``model_runner``'s KV geometry."""
    c = model_runner.config
    kv = KVCacheManager(model_runner.num_blocks, model_runner.block_size)
    return Engine(runner, kv, tokenizer, b"gpu-check", c.eos_token_ids, c.max_position_embeddings,
                  c.vocab_size, config)


def greedy_request(prompt: list[int], max_tokens: int) -> EngineRequest:
    """Greedy, EOS ignored: every request produces exactly ``max_tokens`` tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True).validate()
    return EngineRequest(f"req{next(_ids)}", tuple(prompt), params)


@dataclass
class Trace:
    """One request through the engine: its tokens (prompt + output) and recorded logits."""

    tokens: list[int]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    cached_prompt_tokens: int = 0


def _run_to_completion(engine: Engine, traces: dict[str, Trace]) -> None:
    while engine.has_work:
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"{out.request_id} failed in the engine") from out.error
            traces[out.request_id].tokens += out.token_ids
            if out.finished:
                traces[out.request_id].cached_prompt_tokens = out.usage.cached_prompt_tokens


def parity_traces(runner: ModelRunner, tokenizer: tokenizers.Tokenizer, new_tokens: int,
                  seed: int = 0) -> dict[str, Trace]:
    """Run the parity workload (:data:`PARITY_PROMPT_LENS` together, chunked, then the
    prefix-sharing request once the first wave's blocks are cached) and return each request's
    trace. Raises RuntimeError if the engine fails a request."""
    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PARITY_PROMPT_LENS]
    shared = prompts[-1][:SHARED_PREFIX] + [rng.randrange(3, vocab) for _ in range(SHARED_SUFFIX)]
    recorder = RecordingExecutor(runner)
    engine = make_engine(recorder, runner, tokenizer, PARITY_CONFIG)
    traces: dict[str, Trace] = {}
    for wave in (prompts, [shared]):
        for prompt in wave:
            req = greedy_request(prompt, new_tokens)
            engine.add_request(req)
            traces[req.request_id] = Trace(list(prompt))
        _run_to_completion(engine, traces)
    for request_id, trace in traces.items():
        trace.rows = recorder.rows[request_id]
    return traces


@torch.inference_mode()
def reference_logits(model, tokens: list[int], device: torch.device) -> torch.Tensor:
    """transformers' full-prefix forward: float32 ``(len(tokens), vocab)`` on the CPU."""
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    return model(input_ids=ids, use_cache=False).logits[0].float().cpu()


def compare(traces: dict[str, Trace], models: dict[str, object], device: torch.device
            ) -> dict[str, dict[str, float]]:
    """Each model's full-prefix logits at every recorded position vs the engine's.

    Returns, per model name: ``max_abs`` (max |engine - model| over all rows), ``scale``
    (max(1, max |model|)), ``top1`` (fraction of rows with the same argmax), and ``vs_<other>``
    = max |model - other| for every other model (e.g. transformers bf16 vs fp32).
    """
    stacked: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    ours = []
    for trace in traces.values():
        positions = sorted(trace.rows)
        ours.append(torch.stack([trace.rows[p] for p in positions]))
        for name, model in models.items():
            full = reference_logits(model, trace.tokens[: positions[-1] + 1], device)
            stacked[name].append(full[positions])
    engine = torch.cat(ours)
    refs = {name: torch.cat(rows) for name, rows in stacked.items()}
    out = {}
    for name, ref in refs.items():
        out[name] = {"max_abs": float((engine - ref).abs().max()),
                     "scale": max(1.0, float(ref.abs().max())),
                     "top1": float((engine.argmax(-1) == ref.argmax(-1)).float().mean()),
                     "rows": len(ref)}
        for other, ref2 in refs.items():
            if other != name:
                out[name][f"vs_{other}"] = float((ref - ref2).abs().max())
    return out


@dataclass(frozen=True)
class DecodeRate:
    """Decode-only throughput of one system at one batch size (prefill excluded)."""

    batch: int
    tokens: int      # tokens produced by the timed decode steps
    seconds: float   # wall time of those steps, device synchronised at both ends

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        """Milliseconds per decode step of the whole batch."""
        return 1e3 * self.seconds * self.batch / self.tokens


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` seeded prompts of ``length`` token ids in ``[3, vocab)`` (no special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def engine_decode_rate(runner: ModelRunner, tokenizer: tokenizers.Tokenizer,
                       prompts: list[list[int]], new_tokens: int, repeats: int) -> DecodeRate:
    """``len(prompts)`` requests of ``new_tokens`` each through a fresh engine: steps until
    every request has its first token (the prefill, untimed), then times the remaining steps,
    all pure decodes of the whole batch. Best of ``repeats``."""
    batch = len(prompts)
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, sum(map(len, prompts))))
    best = None
    for _ in range(repeats):
        engine = make_engine(runner, runner, tokenizer, config)
        firsts: set[str] = set()
        for prompt in prompts:
            engine.add_request(greedy_request(prompt, new_tokens))
        while len(firsts) < batch:
            firsts.update(o.request_id for o in engine.step() if o.token_ids)
        sync(runner.device)
        t0, tokens = time.perf_counter(), 0
        while engine.has_work:
            tokens += sum(len(o.token_ids) for o in engine.step())
        sync(runner.device)
        rate = DecodeRate(batch, tokens, time.perf_counter() - t0)
        best = rate if best is None or rate.seconds < best.seconds else best
    return best


def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int, device: torch.device,
                   repeats: int) -> DecodeRate:
    """transformers ``generate`` (greedy, EOS off) on the same prompts: decode time = from the
    first token's logits (prefill done) to the end, timed inside one call by a logits
    processor, for ``batch × (new_tokens - 1)`` tokens; the best of ``repeats`` runs.

    (Subtracting a 1-token run's time from a full run's went negative on a loaded CPU.)"""
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    model.generation_config.eos_token_id = None  # every row runs to new_tokens
    marks: list[float] = []

    def mark(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not marks:
            sync(device)  # the prefill's logits are ready: decoding starts now
            marks.append(time.perf_counter())
        return scores

    best = None
    for _ in range(repeats):
        marks.clear()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([mark]))
        sync(device)
        seconds = time.perf_counter() - marks[0]
        assert out.shape[1] == ids.shape[1] + new_tokens, "generate stopped early"
        best = seconds if best is None else min(best, seconds)
    return DecodeRate(len(prompts), len(prompts) * (new_tokens - 1), best)
