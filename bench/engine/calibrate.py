"""Measure a real replica's forward to get the cost model's constants.

    .venv/bin/python -m bench.engine.calibrate [--out bench/results/calibration.json]

Builds the real :class:`~kvfleet.worker.runner.model_runner.ModelRunner` on the prepared SmolLM2
(fp32, one torch thread: what each of two replicas gets on a 2-core machine), times the step
shapes the router benchmark produces (512-token prefill chunks from an empty and a half-full
context, the 64-token suffix after a 1,024-token cached prefix, decode batches at ~1,088 tokens
of context) plus decode batches at 64 and 2,048 tokens (so the context term varies on its own)
and 4 decode rows beside a chunk of 16, 32 and ``FEW_ROWS`` tokens (the first two within the
few-row kernel's reach, the last past it), and fits the step-cost model's form
(``kvfleet.worker.step_cost.model``: base + prefill tokens + decode rows + KV positions
attended + the GEMM path's fixed cost past ``FEW_ROWS`` query rows) by least squares in
relative error.
The samples, the fit, and the machine's load are written to one JSON file, which the benchmark
reads and records; the constants are never edited by hand. Benchmarks that need the file
call :func:`ensure_calibration`, which measures it on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

from bench.common.result_file import RESULTS

DEFAULT_OUT = RESULTS / "calibration.json"


def ensure_calibration(path: Path = DEFAULT_OUT) -> Path:
    """``path``, measured now (as ``python -m bench.engine.calibrate --out path``; about a minute)
    when it does not exist yet — a fresh clone has no ``bench/results/``."""
    path = Path(path)
    if not path.exists():
        print(f"{path} not found: calibrating the cost model first (bench.engine.calibrate)", flush=True)
        main(["--out", str(path)])
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine.calibrate", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=4, help="timed passes (the first warms up)")
    a = p.parse_args(argv)
    import torch  # here: ensure_calibration's callers need no torch until they calibrate

    from kvfleet.deploy.models import prepare_model
    from kvfleet.worker.runner.model_runner import ModelRunner
    from kvfleet.worker.runner.models.linear import FEW_ROWS
    from kvfleet.worker.step_cost.calibration import calibration_plans, fit, measure, mixed_plan

    torch.set_num_threads(a.threads)
    model_dir = prepare_model(progress=False)
    block_size = 16
    runner = ModelRunner(model_dir, num_blocks=1200, block_size=block_size)
    load_before = os.getloadavg()
    t0 = time.time()
    samples = []
    for sizes, contexts in (([512], [0, 512]), ([64], [0, 1024]), ([16, 128], [1024])):
        samples += measure(runner, calibration_plans(block_size, sizes, contexts, [], 0), a.repeats)
    for batches, context in (([1, 4, 8, 16], 1088), ([1, 8], 64), ([1], 2048)):
        samples += measure(runner, calibration_plans(block_size, [], [], batches, context), a.repeats)
    # decode rows beside a chunk within the few-row kernel's reach and one past it
    samples += measure(runner, [mixed_plan(4, 64, n, block_size) for n in (16, 32, FEW_ROWS)], a.repeats)
    source = (f"SmolLM2-135M-Instruct fp32, {a.threads} torch thread(s), {platform.node()} "
              f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}")
    cost = fit(samples, source, few_rows=FEW_ROWS)
    record = {
        "cost_model": cost.to_json(),
        "samples": [asdict(s) | {"fitted_s": cost.predict_step_s(s.decode_tokens, s.prefill_tokens,
                                                                 s.context_tokens)}
                    for s in samples],
        "machine": {"cpus": os.cpu_count(), "torch_threads": a.threads,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "seconds": time.time() - t0,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["cost_model"], indent=2))
    for s in record["samples"]:
        print(f"  prefill {s['prefill_tokens']:4d} decode {s['decode_tokens']:3d} attended "
              f"{s['context_tokens']:7d}: {s['seconds'] * 1e3:8.1f} ms (fit {s['fitted_s'] * 1e3:8.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
