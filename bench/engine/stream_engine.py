"""Decode streams beside periodic long prompts on the real engine in real time, target off and on.

    .venv/bin/python -m bench stream_engine [--streams 4] [--prompt 480] [--period 1.5]
        [--target-x 3] [--seconds 30] [--threads 1] [--out DIR]

``bench stream_sim``'s workload (the first row of docs/slo.md's client-side table) through
the real engine and SmolLM2 in this process, on the wall clock: ``--streams`` greedy streams
(64-token prompts, 256 tokens, replaced when done) and a ``--prompt``-token request (16
tokens) every ``--period`` seconds. No router, Ray or gRPC: what is left of row 1's
difference between target off and on is the engine's. The step-cost model is calibrated
first (as a replica does, not cached) and corrected online; the target is ``--target-x`` ×
one stream's measured ITL alone. Each step is traced (``steps.json`` in ``--out``): its
shape, predicted and measured forward, the whole ``engine.step()``, and under the target the
paced prompts' remaining tokens and seconds left to their deadlines, the floor and the tokens
the target leaves the first. Prints both runs' ITL p50 / p99, tok/s and long TTFT p50 / p99, on ÷ off,
and the trace's summary (:func:`bench.engine.step_trace.summarize`).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.common.result_file import RESULTS
from bench.common.stream_stats import pct, stream_row
from bench.engine import engine_runs as er
from bench.engine.step_trace import TracingStepCost, summarize
from bench.sim.stream_sim import LONG_TOKENS, STREAM_PROMPT, STREAM_TOKENS, workload_args
from kvfleet.deploy.models import prepare_model
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.scheduling import step_budget as sb
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.step_cost.calibration import CalibrationKey, device_name, load_or_calibrate


class PaceTrace:
    """Records what :meth:`StepBudget.pace_queue` decided each step (patched in while in a
    ``with``): the queue paced (tokens, seconds left each), the floor, and the tokens the
    target alone leaves the first prompt."""

    def __init__(self) -> None:
        self.last: dict = {}
        self._orig = sb.StepBudget.pace_queue

    def __enter__(self) -> "PaceTrace":
        orig, trace = self._orig, self

        def pace_queue(budget, num_computed, queue):
            floor = orig(budget, num_computed, queue)
            fits = budget._fits(num_computed, min(queue[0][0], budget.tokens_left))
            trace.last = {"queue": [list(q) for q in queue], "floor": floor,
                          "target_left": fits, "decodes_s": budget.decodes_s}
            return floor

        sb.StepBudget.pace_queue = pace_queue
        return self

    def __exit__(self, *exc) -> None:
        sb.StepBudget.pace_queue = self._orig


def request(rid: str, ids: list[int], n: int) -> EngineRequest:
    return EngineRequest(rid, tuple(ids), SamplingParams(max_tokens=n, ignore_eos=True).validate())


def run(factory: er.EngineFactory, config: SchedulerConfig, cost: TracingStepCost, streams: int,
        prompt: int, period: float, seconds: float, seed: int = 0) -> tuple[dict, list, dict]:
    """One run; returns its stream row, the step trace and every request's tokens."""
    engine = factory.engine(config, cost)
    sent: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    counts = [0] * streams
    trace: list[dict] = []
    deadlines: dict[str, float] = {}  # request id → the deadline the floor fixed for it

    def add(rid: str, ids: list[int], n: int, now: float) -> None:
        sent[rid], stamps[rid], tokens[rid] = now, [], []
        engine.add_request(request(rid, ids, n))

    def new_stream(k: int, now: float) -> None:
        rng = random.Random(seed * 1000 + k * 100 + counts[k])
        add(f"s{k}_{counts[k]}", [rng.randrange(100, 40000) for _ in range(STREAM_PROMPT)],
            STREAM_TOKENS, now)
        counts[k] += 1

    t0 = time.monotonic()
    for k in range(streams):
        new_stream(k, t0)
    next_long, i = t0, 0
    with PaceTrace() as pt:
        while True:
            now = time.monotonic()
            if now - t0 >= seconds:
                break
            while next_long <= now:
                rng = random.Random(seed * 1000 + 50_000 + i)
                add(f"L{i}", [rng.randrange(100, 40000) for _ in range(prompt)], LONG_TOKENS,
                    next_long)
                i, next_long = i + 1, next_long + period
            if not engine.has_work:
                time.sleep(max(0.0, next_long - now))
                continue
            pt.last, n_rec = {}, len(cost.records)
            outs = engine.step()
            end = time.monotonic()
            for (seq_id, _), at in engine.scheduler.pace._deadlines.items():
                deadlines.setdefault(seq_id.split("#")[0], at)
            cost.step_done(end - now)
            if len(cost.records) > n_rec:
                trace.append({**asdict(cost.records[-1]), **pt.last, "t": now - t0})
            for o in outs:
                stamps[o.request_id] += [end] * len(o.token_ids)
                tokens[o.request_id] += list(o.token_ids)
                if o.finished and o.request_id.startswith("s"):
                    new_stream(int(o.request_id[1:].split("_")[0]), end)
    elapsed = time.monotonic() - t0
    itl = [b - a for r, s in stamps.items() if r.startswith("s") for a, b in zip(s, s[1:], strict=False)]
    ttft = [s[0] - sent[r] for r, s in stamps.items() if r.startswith("L") and s]
    row = stream_row(itl, ttft, sum(len(t) for t in tokens.values()) / elapsed)
    row["prompts"] = {r: {"ttft_s": s[0] - sent[r], "deadline_s": deadlines[r] - sent[r]
                          if r in deadlines else None} for r, s in stamps.items()
                      if r.startswith("L") and s}
    return row, trace, tokens


def main(argv: list[str] | None = None) -> int:
    p = workload_args("python -m bench stream_engine", __doc__ or "", 30.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a replica's default: 1)")
    p.add_argument("--calibration-s", type=float, default=15.0)
    p.add_argument("--out", type=Path, default=RESULTS / "stream_engine")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    load = {"start": os.getloadavg()}
    off = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    factory = er.EngineFactory(prepare_model(progress=False), 2048, off)
    key = CalibrationKey("bench", device_name("cpu"), 1, "float32", a.threads)
    prior = load_or_calibrate(LocalExecutor(factory.runner), key, None, a.calibration_s)
    print(f"calibrated: {prior}", flush=True)
    single = er.decode_step_s(factory, list(range(100, 100 + STREAM_PROMPT)), 48)
    on = replace(off, itl_target_ms=a.target_x * single * 1e3)
    print(f"single-stream ITL {single * 1e3:.1f} ms; target {on.itl_target_ms:.0f} ms", flush=True)
    rows, traces, outs = {}, {}, {}
    for name, config in (("off", off), ("on", on)):
        cost = TracingStepCost(prior)
        rows[name], traces[name], outs[name] = run(factory, config, cost, a.streams, a.prompt,
                                                   a.period, a.seconds)
        recs = cost.records
        rows[name]["trace"] = summarize(recs, None if name == "off" else on.itl_target_ms / 1e3)
        rows[name]["scales"] = {"decode": cost.decode_scale, "prefill": cost.prefill_scale}
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "prompts"}, indent=1),
              flush=True)
        late = [p["ttft_s"] - p["deadline_s"] for p in rows[name]["prompts"].values()
                if p["deadline_s"] is not None]
        if late:
            print(f"{name}: first token - planned deadline p50 {pct(late, 0.5) * 1e3:.0f} ms, "
                  f"p90 {pct(late, 0.9) * 1e3:.0f} ms, max {max(late) * 1e3:.0f} ms "
                  f"({len(late)} prompts)", flush=True)
    load["end"] = os.getloadavg()
    both = [r for r in outs["off"] if r in outs["on"]
            and len(outs["off"][r]) == len(outs["on"][r])]
    same = all(outs["off"][r] == outs["on"][r] for r in both)
    x, y = rows["off"], rows["on"]
    line = (f"target {on.itl_target_ms:.0f} ms: ITL p99/p50 {x['itl_p99_over_p50']:.2f} -> "
            f"{y['itl_p99_over_p50']:.2f}, p50 {x['itl_p50_s'] * 1e3:.0f} -> "
            f"{y['itl_p50_s'] * 1e3:.0f} ms; tok/s {y['tokens_per_s'] / x['tokens_per_s']:.3f}x; "
            f"long TTFT p99 {x['long_ttft_p99_s']:.2f} -> {y['long_ttft_p99_s']:.2f} s "
            f"({y['long_ttft_p99_s'] / x['long_ttft_p99_s']:.2f}x); identical {same} "
            f"({len(both)}); load {load}")
    step_on = [t["step_s"] for t in traces["on"]]
    print(f"on: step p50 {pct(step_on, 0.5) * 1e3:.0f} ms")
    print(line)
    (a.out / "steps.json").write_text(json.dumps({"prior": prior.to_json(), "traces": traces,
                                                  "rows": rows, "line": line}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
