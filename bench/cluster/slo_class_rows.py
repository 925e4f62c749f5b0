"""The client-side SLO table's rows 2 and 3 (classes, fairness) on cost-model replicas.

Each row runs an existing cluster bench in a process of its own (Ray, Redis and the router
start clean), once without and once with the replicas' ``--itl-target-ms`` (the classes' and
tenants' step rules act under the target), same seed, and reads its JSON:

* **row 2** (``bench priority --factor 5``): two cost-model replicas behind the real router,
  an interactive Poisson trickle at 0.1 × capacity alone, a batch flood at 5 × alone, then
  both. Interactive TTFT p99 both ÷ alone (target ≤ 1.5), and the replica-seconds batch lost
  beside the trickle against those the trickle's requests took (the replicas' per-class
  forward-seconds counter over each phase's middle half; target lost ≤ trickle's); the same
  from the requests finished in that half and in completions/s is printed beside it, not judged.
* **row 3** (``bench overload fair --tenant-share 0.5``): tenant B (``steady``) at 0.2 ×
  capacity alone, then beside tenant A (``flood``) at 10 ×. B's TTFT p99 both ÷ alone
  (target ≤ 2) and the share of B's requests admitted.

TTFT is the client's (send to first token). Used by ``python -m bench slo_rows --rows 2,3``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

from bench.common.result_file import RESULTS

ROW2_TARGET, ROW3_TARGET = 1.5, 2.0


def _bench(args: list[str], result: str, tries: int = 2) -> dict:
    """``python -m bench ARGS`` in a fresh process (again if it fails: a local Ray start can
    time out on a loaded host), then its JSON result file, parsed.

    Raises:
        subprocess.CalledProcessError: the bench failed ``tries`` times.
    """
    for attempt in range(tries):
        try:
            subprocess.run([sys.executable, "-m", "bench", *args], check=True)
            break
        except subprocess.CalledProcessError:
            if attempt == tries - 1:
                raise
    with open(RESULTS / result) as f:
        return json.load(f)


def row2(seed: int, target_ms: Optional[float], seconds: float, factor: float = 5.0) -> dict:
    """Row 2 once (``target_ms`` None: no ITL target); ``seconds`` per phase. Returns the
    interactive TTFT p99 alone and with the flood (ms), their ratio, batch completions/s
    alone and with the trickle, the trickle's completions/s, and batch's replica-seconds lost
    a second against the trickle's own by the replicas' per-class counters (``rs_drop``,
    ``rs_interactive``, ``rs_ratio``; the judged batch side), and the same ratio from the
    completions that finished in the window (``rs_window_ratio``, not judged)."""
    tag = f"slo-r2-{'on' if target_ms else 'off'}-{seed}"
    args = ["priority", "--factor", str(factor), "--seed", str(seed), "--tag", tag,
            "--duration-s", str(seconds)]
    if target_ms:
        args += ["--itl-target-ms", str(target_ms)]
    r = _bench(args, f"priority-{tag}.json")
    t = r["targets"]
    return {"alone_p99_ms": r["interactive_alone"]["chat"]["ttft_p99_ms"],
            "both_p99_ms": r["both"]["chat"]["ttft_p99_ms"],
            "ratio": t["interactive_ttft_p99_ratio"],
            "batch_alone_per_s": r["batch_alone"]["flood"]["completions_per_s"],
            "batch_both_per_s": r["both"]["flood"]["completions_per_s"],
            "batch_drop_per_s": t["batch_drop_per_s"], "interactive_per_s": t["interactive_per_s"],
            "rs_drop": t["batch_drop_replica_s_per_s"],
            "rs_interactive": t["interactive_replica_s_per_s"], "rs_ratio": t["replica_s_ratio"],
            "rs_window_ratio": t.get("window_replica_s_ratio"),
            "met": bool(t["ttft_target_met"] and t["throughput_target_met"]),
            "load": r["machine"]["loadavg_after"][0]}


def row3(seed: int, target_ms: Optional[float], seconds: float, share: float = 0.5) -> dict:
    """Row 3 once (``target_ms`` None: no ITL target); ``seconds`` per phase. Returns B's
    TTFT p99 alone and beside A's flood (ms), their ratio and B's admitted fraction."""
    tag = f"slo-r3-{'on' if target_ms else 'off'}-{seed}"
    args = ["overload", "fair", "--tenant-share", str(share), "--no-backlogged", "--seed",
            str(seed), "--tag", tag, "--duration-s", str(seconds)]
    if target_ms:
        args += ["--itl-target-ms", str(target_ms)]
    r = _bench(args, f"overload-fair-{tag}.json")
    b = r["with_flood"]["per_tenant"]["steady"]
    ok = b["by_status"].get("OK", 0)
    ratio = r["steady_ttft_p99_ratio"]
    return {"alone_p99_ms": r["steady_alone"].get("ttft_p99_ms"),
            "both_p99_ms": b.get("ttft_p99_ms"), "ratio": ratio,
            "admitted": ok / max(1, b["requests"]),
            "met": ratio is not None and ratio <= ROW3_TARGET,
            "load": r["machine"]["loadavg_after"][0]}


def table_lines(results: dict) -> list[str]:
    """One compact line per row, seed and target setting (``results``: row → seed →
    ``"off"``/``"on"`` → the row function's dict)."""
    lines = []
    for row, seeds in sorted(results.items()):
        for seed, runs in sorted(seeds.items()):
            for k, r in runs.items():
                if row == 2:
                    rs = f"{r['rs_ratio']:.2f}x" if r["rs_ratio"] is not None else "n/a"
                    window = r.get("rs_window_ratio")
                    rs_window = f"{window:.2f}x" if window is not None else "n/a"
                    lines.append(
                        f"row 2 seed {seed} target {k:3s} | interactive TTFT p99 "
                        f"{r['alone_p99_ms']:.0f} -> {r['both_p99_ms']:.0f} ms "
                        f"({r['ratio']:.2f}x, <= {ROW2_TARGET}) | batch lost "
                        f"{r['rs_drop']:.4f} vs interactive {r['rs_interactive']:.4f} replica-s/s "
                        f"({rs}, <= 1; finished in window {rs_window}) "
                        f"| completions {r['batch_alone_per_s']:.2f}"
                        f" -> {r['batch_both_per_s']:.2f}/s (lost {r['batch_drop_per_s']:.2f} vs "
                        f"interactive {r['interactive_per_s']:.2f}/s) | met {r['met']} "
                        f"| load {r['load']:.1f}")
                else:
                    ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
                    lines.append(
                        f"row 3 seed {seed} target {k:3s} | B TTFT p99 "
                        f"{r['alone_p99_ms'] or 0:.0f} -> {r['both_p99_ms'] or 0:.0f} ms "
                        f"({ratio}, <= {ROW3_TARGET}) | B admitted {r['admitted']:.0%} "
                        f"| met {r['met']} | load {r['load']:.1f}")
    return lines
