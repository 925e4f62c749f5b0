"""Predicted against measured forward seconds of decode rows beside prefill chunks of each size.

    .venv/bin/python -m bench chunk_cost [--threads 1] [--repeats 5] [--decode-rows 4]
        [--sizes 16,32,64,128,256,480] [--prompt 480] [--calibration-s 15]

One :class:`~kvfleet.worker.runner.model_runner.ModelRunner` (the default model, fp32), the
start-up calibration a replica runs (not cached), then a ``--prompt``-token prompt computed
in chunks of each of ``--sizes`` tokens, one a step, each step beside ``--decode-rows``
decode rows (192 tokens of context each, a stream midway through its output), and one step
of the decode rows alone. Interleaved ``--repeats`` times (a warm-up pass first, dropped;
each pass in the other direction). Per chunk size: the least and the median seconds of each
of its steps, summed, the calibrated prediction, measured ÷ predicted, and the prompt's own
seconds a token (the steps less as many steps of the rows alone, ÷ the prompt's tokens):
whether the linear model (:mod:`kvfleet.worker.step_cost.model`), whose prefill term is one
price a token, prices a prompt cut into the small chunks an ITL target's steps carry as it
prices the whole prompt a step without the target runs. JSON: ``bench/results/chunk_cost.json``.
Time on a loaded host is noisy: the load average is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.common.result_file import RESULTS

CONTEXT = 192  # tokens each decode row follows


def plans(block_size: int, rows: int, sizes: list[int], prompt: int):
    """``{size: [plan, ...]}``: a ``prompt``-token prompt computed in chunks of ``size`` tokens,
    one a step, each beside ``rows`` decode rows (size 0: one step of the rows alone), on
    disjoint blocks."""
    from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan

    per = -(-(CONTEXT + 1) // block_size)
    decodes = tuple(SeqChunk(f"d{i}", (7,), CONTEXT, tuple(range(i * per, (i + 1) * per)))
                    for i in range(rows))
    ids = tuple(11 + i % 900 for i in range(prompt))
    table = tuple(range(rows * per, rows * per + -(-prompt // block_size)))
    out = {0: [StepPlan(decodes)]}
    for n in sizes:
        out[n] = [StepPlan(decodes + (SeqChunk("p", ids[at:at + n], at,
                                               table[:-(-(at + len(ids[at:at + n])) // block_size)]),))
                  for at in range(0, prompt, n)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine.chunk_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed passes (+1 warm-up)")
    p.add_argument("--decode-rows", type=int, default=4)
    p.add_argument("--sizes", default="16,32,64,128,256,480")
    p.add_argument("--prompt", type=int, default=480, help="the prompt's tokens, in chunks of each size")
    p.add_argument("--calibration-s", type=float, default=15.0)
    a = p.parse_args(argv)
    import torch

    from kvfleet.deploy.models import prepare_model
    from kvfleet.worker.executor.local import LocalExecutor
    from kvfleet.worker.runner.model_runner import ModelRunner
    from kvfleet.worker.step_cost.calibration import CalibrationKey, device_name, load_or_calibrate

    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    runner = ModelRunner(prepare_model(progress=False), num_blocks=400, block_size=16)
    key = CalibrationKey("bench", device_name("cpu"), 1, "float32", a.threads)
    prior = load_or_calibrate(LocalExecutor(runner), key, None, a.calibration_s)
    sizes = [int(x) for x in a.sizes.split(",")]
    shapes = plans(16, a.decode_rows, sizes, a.prompt)
    # each step's seconds over the passes: a prompt's steps summed step by step (a burst of
    # load then spoils one step of one pass, not a whole pass of a chunk size)
    times: dict[int, list[list[float]]] = {n: [[] for _ in steps] for n, steps in shapes.items()}
    order = list(shapes)
    for r in range(a.repeats + 1):
        for n in (order if r % 2 == 0 else order[::-1]):
            for plan, seen in zip(shapes[n], times[n], strict=True):
                t0 = time.perf_counter()
                runner.execute(plan)
                if r:
                    seen.append(time.perf_counter() - t0)
    low = {n: sum(min(v) for v in steps) for n, steps in times.items()}
    med = {n: sum(statistics.median(v) for v in steps) for n, steps in times.items()}
    rows = []
    for n, steps in shapes.items():
        predicted = sum(prior.step_seconds(plan) for plan in steps)
        row = {"chunk": n, "steps": len(steps), "min_s": low[n], "median_s": med[n],
               "predicted_s": predicted, "min_over_predicted": low[n] / predicted,
               "median_over_predicted": med[n] / predicted}
        if n:  # the prompt's own seconds: its steps less as many steps of the rows alone
            row["prompt_s_per_token_min"] = (low[n] - len(steps) * low[0]) / a.prompt
            row["prompt_s_per_token_median"] = (med[n] - len(steps) * med[0]) / a.prompt
            row["predicted_s_per_token"] = (predicted - len(steps) * prior.step_seconds(shapes[0][0])
                                            ) / a.prompt
        rows.append(row)
    out = {"prior": prior.to_json(), "rows": rows, "args": vars(a),
           "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg()}}
    print(f"prior: prefill {prior.prefill_token_s * 1e3:.2f} ms/token, base {prior.step_base_s * 1e3:.1f} "
          f"ms, decode row {prior.decode_token_s * 1e3:.2f} ms, GEMM-path step "
          f"{prior.gemm_step_s * 1e3:.1f} ms past {prior.few_rows} rows")
    print("chunk steps  min ms  med ms  pred ms  min/pred  med/pred  prompt ms/token: min, med, pred")
    for r in rows:
        per = (f"{r['prompt_s_per_token_min'] * 1e3:.2f}, {r['prompt_s_per_token_median'] * 1e3:.2f}, "
               f"{r['predicted_s_per_token'] * 1e3:.2f}" if r["chunk"] else "-")
        print(f"{r['chunk']:5d} {r['steps']:5d} {r['min_s'] * 1e3:7.1f} {r['median_s'] * 1e3:7.1f} "
              f"{r['predicted_s'] * 1e3:8.1f} {r['min_over_predicted']:9.2f} "
              f"{r['median_over_predicted']:9.2f}  {per}")
    print(f"load {load_before} -> {os.getloadavg()}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chunk_cost.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
