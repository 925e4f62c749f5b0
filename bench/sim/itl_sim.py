"""The ITL target's scheduling on a virtual clock: the real scheduler and block pool, each
step lasting exactly what a cost model says (plus a fixed per-step overhead), so what the
policy does (floor growth, chunk sizes, seats held by slow prefills) shows apart from how
well a model predicts a real machine and from a loaded host's noise.

    .venv/bin/python -m bench itl_sim [--itl-target-ms 150] [--cost JSON] [--overhead-ms 0]
                                      [--prefill-error 2] [--noise 0.3]

Workload: the engine bench's (``bench.engine.engine_bench.workload``: 32 requests at t=0, prompts
16-512 tokens, outputs 8-128; ``max_num_seqs`` 16, ``max_num_batched_tokens`` 512). The
default cost model is SmolLM2-135M fp32 at 2 threads on an idle 2-core host as the engine
bench saw it (ITL p50 ~60 ms for 16 decode rows, ~0.8 s for a 512-token chunk); ``--cost``
reads a calibration file instead. Prints the ``bench itl`` table for target off and on.

``--prefill-error F`` / ``--noise S``: the scheduler plans with a calibration whose prefill
token costs ``1/F`` of the true one, corrected online (the replica's ``StepCost``, alpha
0.05), and each step lasts its true time × a log-normal factor of sd ``S`` (seeded): how well
the online correction recovers a wrong calibration on a noisy host.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import replace

from bench.common.stream_stats import pct
from bench.engine.engine_bench import workload
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.step_cost.model import CostModel, StepCost, plan_shape

BLOCK = 16
IDLE_SMOLLM2 = CostModel(0.025, 0.0015, 0.002, "SmolLM2 2 threads, idle host (engine bench)", 1e-6)


def simulate(requests: list[tuple[list[int], int]], config: SchedulerConfig, cost: CostModel,
             overhead_s: float = 0.0, planner: StepCost | None = None, noise: float = 0.0,
             seed: int = 0) -> dict:
    """Run ``requests`` (all at t=0) to completion on the virtual clock, each step lasting
    ``cost``'s time × ``exp(N(0, noise))``; the scheduler plans with ``planner`` (default:
    ``cost`` itself, uncorrected), which observes every step. Returns tokens/s, ITL and TTFT
    percentiles (s), the number of steps and the planner's last scales."""
    num_blocks = 16 * -(-max(len(q) + n for q, n in requests) // BLOCK) + 64
    planner = planner or StepCost(cost, alpha=0.0)
    rng = random.Random(seed)
    sched = Scheduler(config, KVCacheManager(num_blocks, BLOCK), planner)
    seqs = [SequenceState(seq_id=f"r{i}", request_id=f"r{i}", index=0, prompt_token_ids=list(q),
                          params=SamplingParams(max_tokens=n, ignore_eos=True), root_hash=b"s" * 16,
                          block_size=BLOCK, arrival_seq=i) for i, (q, n) in enumerate(requests)]
    for s in seqs:
        s.timing.arrival = 0.0
    sched.add(seqs)
    stamps: dict[str, list[float]] = {s.seq_id: [] for s in seqs}
    now, steps = 0.0, 0
    while sched.num_unfinished:
        out = sched.schedule(now)
        sched.on_step_done(out)
        forward_s = cost.step_seconds(out.plan) * (math.exp(rng.gauss(0, noise)) if noise else 1.0)
        planner.observe(plan_shape(out.plan), forward_s)
        now += forward_s + overhead_s
        steps += 1
        for x in out.scheduled:
            if x.sample and x.seq.status is SeqStatus.RUNNING:
                x.seq.append_token(1)
                stamps[x.seq.seq_id].append(now)
                if len(x.seq.output_token_ids) >= x.seq.params.max_tokens:
                    sched.finish(x.seq)
    itl = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    ttft = [ts[0] for ts in stamps.values()]
    return {"tokens_per_s": sum(len(t) for t in stamps.values()) / now, "steps": steps,
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "itl_p99_over_p50": pct(itl, 0.99) / pct(itl, 0.5),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "scales": {"decode": planner.decode_scale, "prefill": planner.prefill_scale}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench itl_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--itl-target-ms", type=float, default=150.0)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--cost", help="calibration JSON (default: the idle SmolLM2 model above)")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="per step, outside the forward")
    p.add_argument("--prefill-error", type=float, default=None,
                   help="plan with prefill tokens priced 1/F of their cost, corrected online")
    p.add_argument("--noise", type=float, default=0.0, help="sd of log(step time) around the model")
    a = p.parse_args(argv)
    cost = CostModel.load(a.cost) if a.cost else IDLE_SMOLLM2
    reqs = workload(a.requests, (16, 512), (8, 128), 2)
    off = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)

    def planner() -> StepCost | None:
        if a.prefill_error is None:
            return None
        return StepCost(replace(cost, prefill_token_s=cost.prefill_token_s / a.prefill_error))

    runs = {k: simulate(reqs, c, cost, a.overhead_ms / 1e3, planner(), a.noise)
            for k, c in (("off", off), ("on", replace(off, itl_target_ms=a.itl_target_ms)))}
    print(json.dumps({"cost": cost.to_json(), **runs}, indent=1))
    print(f"throughput on ÷ off {runs['on']['tokens_per_s'] / runs['off']['tokens_per_s']:.3f}, "
          f"TTFT p99 on ÷ off {runs['on']['ttft_p99_s'] / runs['off']['ttft_p99_s']:.2f}, "
          f"ITL p99/p50 off {runs['off']['itl_p99_over_p50']:.2f} on {runs['on']['itl_p99_over_p50']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
