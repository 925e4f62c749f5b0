"""Decode streams beside periodic long prompts, ITL target off and on, on a virtual clock.

    .venv/bin/python -m bench stream_sim [--streams 4] [--prompt 480] [--period 1.5]
                                         [--target-x 3] [--seconds 60] [--overhead-ms 0]

The shape of the first row of docs/slo.md's client-side table, through the real scheduler and
block pool, each step lasting what the cost model says (default: SmolLM2 at 2 threads on an
idle host, as ``bench itl_sim``): ``--streams`` requests decode all the time (64-token prompts;
a finished one is replaced at once), and a ``--prompt``-token request with 16 output tokens
arrives every ``--period`` seconds. The target is ``--target-x`` × one stream's predicted step
plus ``--overhead-ms`` (its single-stream ITL; the overhead is time outside the forward, which
the scheduler's cost model does not see). Prints, target off and on: the streams' ITL p50 /
p99 and their ratio, output tokens/s, and the long prompts' TTFT p50 / p99 (arrival to first token); then
on ÷ off. Greedy tokens are not modelled here (``bench itl`` compares them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import replace

from bench.common.stream_stats import pct, stream_row
from bench.sim.itl_sim import IDLE_SMOLLM2
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.step_cost.calibration import startup_plans
from kvfleet.worker.step_cost.fit import StepSample, fit
from kvfleet.worker.step_cost.model import CostModel, StepCost, past_few_rows, plan_shape

BLOCK = 16
STREAM_PROMPT = 64
STREAM_TOKENS = 256  # a stream's output before it is replaced by a fresh one
LONG_TOKENS = 16


def simulate(config: SchedulerConfig, cost: CostModel, streams: int, prompt: int, period: float,
             seconds: float, overhead_s: float = 0.0, noise: float = 0.0, planner: StepCost | None = None,
             seed: int = 0, pair_s: float = 0.0, chunk_s: float = 0.0) -> dict:
    """Run the workload for ``seconds`` of virtual time, each step lasting ``cost``'s time, plus
    ``pair_s`` for each query × prefix key of its continued prompt chunks (a chunk of ``n``
    tokens after ``c`` computed ones: ``n · c``, a cost the linear model has no term for), plus
    ``chunk_s`` for a step with prefill within the few-row kernel (``cost.few_rows``; a fixed
    cost no term prices), ×
    ``exp(N(0, noise))`` (seeded) + ``overhead_s``; the scheduler plans with ``planner``
    (default: ``cost`` itself, uncorrected), which observes every forward. Returns the streams'
    ITL p50 / p99 (s), output tokens/s, the long prompts' TTFT p50 / p99 (s), ``prompts``:
    each long prompt's (arrival, deadline the floor planned or None, first token) in seconds,
    and ``steps`` / ``prefill_steps`` / ``prefill_tokens``: the forwards run, those carrying
    prefill (a chunk of more than one token), and their prefill tokens."""
    planner = planner or StepCost(cost, alpha=0.0)
    rng = random.Random(seed)
    sched = Scheduler(config, KVCacheManager(4096, BLOCK), planner)
    deadlines: dict[str, float] = {}
    prompts: list[list] = []
    counter = iter(range(10**9))

    def new(prompt_len: int, max_tokens: int, now: float, kind: str) -> SequenceState:
        i = next(counter)
        s = SequenceState(seq_id=f"{kind}{i}", request_id=f"{kind}{i}", index=0,
                          prompt_token_ids=[1 + (i * 31 + j) % 900 for j in range(prompt_len)],
                          params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          root_hash=b"s" * 16, block_size=BLOCK, arrival_seq=i)
        s.timing.arrival = now
        sched.add([s])
        return s

    last: dict[str, float] = {}
    itl: list[float] = []
    ttft: list[float] = []
    tokens = 0
    counts = {"steps": 0, "prefill_steps": 0, "prefill_tokens": 0}
    now, next_long = 0.0, 0.0
    live = [new(STREAM_PROMPT, STREAM_TOKENS, now, "s") for _ in range(streams)]
    while now < seconds:
        while next_long <= now:
            new(prompt, LONG_TOKENS, next_long, "L")
            next_long += period
        out = sched.schedule(now)
        sched.on_step_done(out)
        for (seq_id, _), at in sched.pace._deadlines.items():
            deadlines.setdefault(seq_id, at)
        step_s = cost.step_seconds(out.plan) + pair_s * sum(
            len(c.token_ids) * c.num_computed_tokens for c in out.plan.chunks if len(c.token_ids) > 1)
        shape = plan_shape(out.plan)
        if chunk_s and shape.prefill_tokens and not past_few_rows(cost.few_rows, sum(shape) - shape[2]):
            step_s += chunk_s
        if step_s == 0.0:  # idle until the next arrival
            now = next_long
            continue
        counts["steps"] += 1
        counts["prefill_steps"] += shape.prefill_tokens > 0
        counts["prefill_tokens"] += shape.prefill_tokens
        if noise:
            step_s *= math.exp(rng.gauss(0, noise))
        planner.observe(plan_shape(out.plan), step_s)
        planner.observe_outside(overhead_s)
        now += step_s + overhead_s
        for x in out.scheduled:
            seq = x.seq
            if not x.sample or seq.status is not SeqStatus.RUNNING:
                continue
            seq.append_token(1)
            tokens += 1
            if seq.seq_id.startswith("s"):
                if seq.seq_id in last:
                    itl.append(now - last[seq.seq_id])
                last[seq.seq_id] = now
            elif len(seq.output_token_ids) == 1:
                ttft.append(now - seq.timing.arrival)
                prompts.append([seq.timing.arrival, deadlines.get(seq.seq_id), now])
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq)
                if seq in live:
                    live[live.index(seq)] = new(STREAM_PROMPT, STREAM_TOKENS, now, "s")
    return {**stream_row(itl, ttft, tokens / now), "prompts": prompts, **counts}


def calibrated(truth: CostModel, chunk_s: float, startup: str) -> CostModel:
    """The fit a start-up calibration makes, on a quiet host, of steps lasting ``truth``'s time
    (+ ``chunk_s`` for a step with prefill within the few-row kernel, as :func:`simulate`):
    ``startup`` ``"kernel"``: the start-up shapes and the GEMM-path term at ``truth.few_rows``;
    ``"linear"``: the shapes and form before them (one mixed step, 4 decode rows + a 64-token
    chunk, and no such term)."""
    samples = []
    for p in startup_plans(4096, BLOCK, 2048, 1000):
        sh = plan_shape(p)
        if startup == "linear" and sh.decode_rows and sh.prefill_tokens and sh.prefill_tokens != 64:
            continue
        rows = sh.decode_rows + sh.prefill_tokens + sh.draft_tokens
        extra = chunk_s if sh.prefill_tokens and not past_few_rows(truth.few_rows, rows) else 0.0
        samples.append(StepSample(sh.prefill_tokens, sh.decode_rows, sh.context_tokens,
                                  truth.step_seconds(p) + extra, sh.draft_tokens))
    return fit(samples, f"{startup} start-up fit of {truth.source}",
               few_rows=truth.few_rows if startup == "kernel" else 0)


def compare(cost: CostModel, streams: int = 4, prompt: int = 480, period: float = 1.5,
            target_x: float = 3.0, seconds: float = 60.0, overhead_s: float = 0.0,
            noise: float = 0.0, prefill_error: float | None = None, seed: int = 0,
            pair_s: float = 0.0, chunk_s: float = 0.0, startup: str | None = None) -> dict:
    """Target off and on (``target_x`` × one stream's predicted step), and on ÷ off. With
    ``noise``, ``prefill_error`` (the planner prices prefill tokens 1/F of their cost),
    ``pair_s`` (continued chunks cost that more a query × prefix key: :func:`simulate`),
    ``chunk_s`` (:func:`simulate`) or ``startup`` (the planner starts from :func:`calibrated`'s
    fit of ``cost``) the scheduler plans with a :class:`StepCost` corrected online, as a
    replica's is. ``lateness``: the long prompts' first token − the deadline the floor planned
    (s; p50, p90, max)."""
    single = cost.predict_step_s(1, 0, STREAM_PROMPT + STREAM_TOKENS // 2) + overhead_s
    off = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    on = replace(off, itl_target_ms=target_x * single * 1e3)

    def planner() -> StepCost | None:
        if not noise and prefill_error is None and not pair_s and not chunk_s and startup is None:
            return None
        prior = cost if startup is None else calibrated(cost, chunk_s, startup)
        return StepCost(prior if prefill_error is None else replace(
            prior, prefill_token_s=prior.prefill_token_s / prefill_error))

    runs = {k: simulate(c, cost, streams, prompt, period, seconds, overhead_s, noise, planner(), seed,
                        pair_s, chunk_s) for k, c in (("off", off), ("on", on))}
    a, b = runs["off"], runs["on"]
    late = [first - d for _, d, first in b["prompts"] if d is not None]
    return {"target_ms": on.itl_target_ms, **runs,
            "lateness_s": {"p50": pct(late, 0.5), "p90": pct(late, 0.9), "max": max(late, default=0.0)},
            "ratios": {"itl_p50": b["itl_p50_s"] / a["itl_p50_s"],
                       "tokens_per_s": b["tokens_per_s"] / a["tokens_per_s"],
                       "long_ttft_p99": b["long_ttft_p99_s"] / a["long_ttft_p99_s"]}}


def workload_args(prog: str, doc: str, seconds: float) -> argparse.ArgumentParser:
    """A parser with the workload's flags (streams, prompt, period, target × single, seconds),
    shared with ``bench stream_engine``."""
    p = argparse.ArgumentParser(prog=prog, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt", type=int, default=480)
    p.add_argument("--period", type=float, default=1.5)
    p.add_argument("--target-x", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=seconds)
    return p


def main(argv: list[str] | None = None) -> int:
    p = workload_args("python -m bench stream_sim", __doc__ or "", 60.0)
    p.add_argument("--overhead-ms", type=float, default=0.0)
    p.add_argument("--cost", help="calibration JSON (default: bench itl_sim's idle SmolLM2)")
    p.add_argument("--noise", type=float, default=0.0, help="sd of log(step time) around the model")
    p.add_argument("--prefill-error", type=float, default=None,
                   help="plan with prefill tokens priced 1/F of their cost, corrected online")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-pair-us", type=float, default=0.0,
                   help="continued prompt chunks cost this more a query x prefix key (µs), unpriced")
    p.add_argument("--gemm-step-ms", type=float, default=None,
                   help="steps past --few-rows query rows cost this more (the GEMM path)")
    p.add_argument("--few-rows", type=int, default=64, help="the few-row kernel's reach (rows)")
    p.add_argument("--chunk-step-ms", type=float, default=0.0,
                   help="steps with prefill within the kernel's reach cost this more, unpriced")
    p.add_argument("--startup", choices=("kernel", "linear"), default=None,
                   help="plan from a start-up fit of the costs: kernel = the shapes and GEMM-path "
                        "term now, linear = one 64-token mixed step, no such term")
    a = p.parse_args(argv)
    cost = CostModel.load(a.cost) if a.cost else IDLE_SMOLLM2
    if a.gemm_step_ms is not None:
        cost = replace(cost, gemm_step_s=a.gemm_step_ms / 1e3, few_rows=a.few_rows)
    r = compare(cost, a.streams, a.prompt, a.period, a.target_x, a.seconds, a.overhead_ms / 1e3,
                a.noise, a.prefill_error, a.seed, a.prefix_pair_us / 1e6, a.chunk_step_ms / 1e3,
                a.startup)
    if a.startup:
        print("planner prior:", calibrated(cost, a.chunk_step_ms / 1e3, a.startup))
    print(json.dumps({k: v for k, v in r.items() if k not in ("off", "on")}
                     | {k: {x: y for x, y in r[k].items() if x != "prompts"} for k in ("off", "on")},
                     indent=1))
    off, on = r["off"], r["on"]
    print(f"target {r['target_ms']:.0f} ms: ITL p99/p50 {off['itl_p99_over_p50']:.2f} -> "
          f"{on['itl_p99_over_p50']:.2f}, p50 {off['itl_p50_s'] * 1e3:.0f} -> "
          f"{on['itl_p50_s'] * 1e3:.0f} ms; tok/s {r['ratios']['tokens_per_s']:.3f}x; "
          f"long TTFT p99 {off['long_ttft_p99_s']:.2f} -> {on['long_ttft_p99_s']:.2f} s "
          f"({r['ratios']['long_ttft_p99']:.2f}x); lateness p50/p90/max "
          f"{r['lateness_s']['p50'] * 1e3:.0f}/{r['lateness_s']['p90'] * 1e3:.0f}/"
          f"{r['lateness_s']['max'] * 1e3:.0f} ms; steps with prefill {off['prefill_steps']} of "
          f"{off['steps']} -> {on['prefill_steps']} of {on['steps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
