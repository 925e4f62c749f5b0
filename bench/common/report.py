"""Statistics and policy ratios for the router benchmark (its plots: :mod:`bench.common.plots`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence

from bench.common.load import Result


def quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (``q`` in [0, 1]) of a non-empty sequence."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def summarize(results: Sequence[Result], replicas: Sequence[str]) -> dict:
    """TTFT quantiles (seconds), hit rate, load balance over ``replicas``, errors.

    ``load`` of a replica = its requests' summed client-side lifetimes (time-average number of
    requests in flight × duration): ``busiest_load_over_mean`` = max ÷ mean over all replicas.
    """
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    busy = {rid: 0.0 for rid in replicas}
    count = {rid: 0 for rid in replicas}
    for r in ok:
        busy[r.replica] = busy.get(r.replica, 0.0) + (r.done - r.sent)
        count[r.replica] = count.get(r.replica, 0) + 1
    out = {"requests": len(results), "errors": len(results) - len(ok)}
    if not ok:
        return out
    out.update({
        "ttft_p50_s": quantile(ttft, 0.5), "ttft_p90_s": quantile(ttft, 0.9),
        "ttft_p99_s": quantile(ttft, 0.99), "ttft_mean_s": statistics.fmean(ttft),
        "e2e_p50_s": quantile([r.done - r.sent for r in ok], 0.5),
        "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "busiest_load_over_mean": max(busy.values()) / max(1e-12, statistics.fmean(busy.values())),
        "busiest_requests_over_mean": max(count.values()) / max(1e-12, statistics.fmean(count.values())),
        # group 0 is the most popular one: on how many replicas did it hit its prefix?
        "top_group_holders": len({r.replica for r in ok if r.request.group == 0
                                  and r.cached_tokens > 0}),
        "first_errors": sorted({r.error for r in results if r.error})[:3],
    })
    return out


def throughput(results: Sequence[Result], warmup_s: float) -> float:
    """Completions per second after ``warmup_s`` from the first send, until the last send."""
    ok = [r for r in results if r.ok]
    if not ok:
        return 0.0
    t0 = min(r.sent for r in results) + warmup_s
    t1 = max(r.sent for r in results)
    done = [r for r in ok if t0 <= r.done <= t1]
    return len(done) / (t1 - t0) if t1 > t0 else 0.0


def ratio_spread(values: Sequence[float]) -> dict:
    """min / median / max of per-round ratios."""
    vs = sorted(values)
    return {"min": vs[0], "median": statistics.median(vs), "max": vs[-1], "rounds": len(vs)}


def markdown(paths: Sequence[Path]) -> str:
    """One table row per policy run: prefix_aware against round robin (min–max over rounds)."""
    rows = ["| run | pressure | rate | TTFT p50 PA/RR | TTFT p99 PA/RR | hit PA (RR) "
            "| busiest/mean PA (RR) | saturation PA/RR | load avg |",
            "|---|---|---|---|---|---|---|---|---|"]
    import json

    for path in paths:
        d = json.loads(Path(path).read_text())
        if "ratios_vs_round_robin" not in d or "prefix_aware" not in d["ratios_vs_round_robin"]:
            continue
        r, pa, rr = (d["ratios_vs_round_robin"]["prefix_aware"], d["policies"]["prefix_aware"],
                     d["policies"]["round_robin"])

        def span(k: str) -> str:
            return f"{r[k]['median']:.2f} ({r[k]['min']:.2f}–{r[k]['max']:.2f})"
        load = d["machine"]["loadavg_before"][0], d["machine"]["loadavg_after"][0]
        rows.append(
            f"| {d['run']['name']} | {d['cache_pressure']:.1f} | {d['open_loop_rate_per_s']:.2f}/s "
            f"| {span('ttft_p50_s')} | {span('ttft_p99_s')} | {pa['hit_rate']:.3f} "
            f"({rr['hit_rate']:.3f}) | {pa['busiest_load_over_mean']:.2f} "
            f"({rr['busiest_load_over_mean']:.2f}) | {r['saturation_throughput']:.2f}× "
            f"| {load[0]:.1f}→{load[1]:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m bench.common.report bench/results/*.json → the README table
    import sys

    print(markdown([Path(p) for p in sys.argv[1:]]))
