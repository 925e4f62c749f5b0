"""What a layer-yield pause and a nested step really cost on the real model runner.

    .venv/bin/python -m bench nested_cost [--threads 1] [--repeats 5] [--decode-rows 16]
        [--prefill 64] [--nested 64] [--pause-at 0.5]

One :class:`~kvfleet.worker.runner.model_runner.ModelRunner` (the default model, fp32), two
plans shaped like ``bench class_sim``'s: the paused step ``P`` (``--decode-rows`` decode rows
after 128 tokens each and a ``--prefill``-token prompt chunk) and the nested step ``N`` (one
``--nested``-token prompt). Four forwards, interleaved ``--repeats`` times (the first pass
warms up and is dropped; the order of the four turns by one each pass), the least seconds of
each (the pass least disturbed by other work) and the median:

* ``whole_p``: ``P`` unpaused; ``whole_n``: ``N`` alone;
* ``paused_p``: ``P`` paused after ``--pause-at`` of its layers and resumed at once (the
  pause's own cost: ``paused_p - whole_p``);
* ``nested``: ``P`` paused there, ``N`` run whole, ``P`` resumed (what a nested step adds to
  the paused step: ``nested - whole_p``, against ``whole_n``).

The step-cost model prices a nested step as a whole step of its own (its step base included)
and the virtual clock adds ``--yield-cost-layers`` of the paused step for the pause: these
are the measured counterparts. JSON: ``bench/results/nested_cost.json``. Time on a loaded
host is noisy: record the load average (it is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

from bench.common.result_file import RESULTS

CONTEXT = 128  # tokens each decode row of the paused step follows


def plans(block_size: int, decode_rows: int, prefill: int, nested: int):
    """``(P, N)``: the paused step's plan and the nested step's, on disjoint blocks."""
    from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan

    next_block = 0

    def table(tokens: int) -> tuple[int, ...]:
        nonlocal next_block
        n = -(-tokens // block_size)
        next_block += n
        return tuple(range(next_block - n, next_block))

    rows = [SeqChunk(f"d{i}", (7,), CONTEXT, table(CONTEXT + 1)) for i in range(decode_rows)]
    if prefill:
        rows.append(SeqChunk("p", tuple(range(11, 11 + prefill)), 0, table(prefill)))
    n = SeqChunk("n", tuple(range(13, 13 + nested)), 0, table(nested))
    return StepPlan(tuple(rows)), StepPlan((n,))


def pause_after(layer: int) -> Callable[[], bool]:
    """A ``should_yield`` that is true once, after layer ``layer`` (0-based) of a forward."""
    seen = [0]

    def should_yield() -> bool:
        seen[0] += 1
        return seen[0] == layer + 1

    return should_yield


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine.nested_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed passes (+1 warm-up)")
    p.add_argument("--decode-rows", type=int, default=16)
    p.add_argument("--prefill", type=int, default=64, help="the paused step's prompt chunk")
    p.add_argument("--nested", type=int, default=64, help="the nested step's prompt")
    p.add_argument("--pause-at", type=float, default=0.5, help="fraction of layers before it")
    a = p.parse_args(argv)
    import torch

    from kvfleet.deploy.models import prepare_model
    from kvfleet.worker.runner.model_runner import ModelRunner
    from kvfleet.worker.step_cost.model import MEASURED

    torch.set_num_threads(a.threads)
    runner = ModelRunner(prepare_model(progress=False), num_blocks=400, block_size=16)
    layers = len(runner.model.layers)
    at = max(0, min(layers - 2, round(a.pause_at * layers) - 1))
    big, small = plans(16, a.decode_rows, a.prefill, a.nested)

    def whole_p() -> None:
        runner.execute(big)

    def whole_n() -> None:
        runner.execute(small)

    def paused_p() -> None:
        runner.resume(runner.execute_pausable(big, pause_after(at)))

    def nested() -> None:
        paused = runner.execute_pausable(big, pause_after(at))
        runner.execute(small)
        runner.resume(paused)

    runs = {"whole_p": whole_p, "whole_n": whole_n, "paused_p": paused_p, "nested": nested}
    times: dict[str, list[float]] = {k: [] for k in runs}
    load_before = os.getloadavg()
    names = list(runs)
    for r in range(a.repeats + 1):
        for name in names[r % 4:] + names[:r % 4]:  # no forward always follows the same one
            t0 = time.perf_counter()
            runs[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    out = {
        "min_s": low, "median_s": med, "samples_s": times, "pause_after_layer": at + 1,
        "layers": layers, "pause_s": low["paused_p"] - low["whole_p"],
        "nested_adds_s": low["nested"] - low["whole_p"],
        "nested_adds_over_whole_n": (low["nested"] - low["whole_p"]) / low["whole_n"],
        "median_nested_adds_over_whole_n": (med["nested"] - med["whole_p"]) / med["whole_n"],
        "model_whole_n_s": MEASURED.step_seconds(small), "model_step_base_s": MEASURED.step_base_s,
        "args": vars(a),
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
    }
    print(json.dumps({k: v for k, v in out.items() if k != "samples_s"}, indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "nested_cost.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
