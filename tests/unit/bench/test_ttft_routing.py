"""``bench.sim.ttft_routing``'s measurement helpers: steady-state throughput, per-phase p90, the
per-seed ratio statistics and the b2b stream's warm-up."""

from __future__ import annotations

import pytest

from bench.sim.fleet_sim import Result
from bench.sim.ttft_routing import CASES, RAMP, _aggregate, phase_p90s, spread, steady_throughput, stream
from bench.common.workload import Request


def result(i: int, offset: float, e2e: float, ttft: float = 0.1) -> Result:
    return Result(Request(i, 0, (1,), offset), "r000", 1, 0, ttft, e2e)


def test_steady_throughput_ignores_the_cold_first_half():
    # 10 s of cold start, then one completion every 0.5 s.
    ends = [10.0] + [10.0 + 0.5 * k for k in range(1, 10)]
    got = steady_throughput([result(i, 0.0, e) for i, e in enumerate(ends)])
    assert got == pytest.approx(2.0)


def test_phase_p90s_skips_the_warm_up_and_splits_the_rest():
    ttfts = [9.0] * 4 + [float(k) for k in range(10)] + [10.0 + k for k in range(10)]
    res = [result(i, 0.0, 1.0, t) for i, t in enumerate(ttfts)]
    assert phase_p90s(res, 4, 2) == [9.0, 19.0]


def test_spread_and_the_per_seed_ratios():
    s = spread([0.5, 2.0])
    assert (s["mean"], s["geomean"], s["min"], s["max"]) == pytest.approx((1.25, 1.0, 0.5, 2.0))
    assert spread([0.7])["sd"] == 0.0
    run = {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "ttft_p99_s": 4.0, "hit_rate": 0.5, "n": 3}
    half = {**{k: v / 2 for k, v in run.items()}, "n": 3}
    agg = _aggregate([{"prefix_aware": run, "p": half, "rr": run}, {"prefix_aware": half, "p": half}])
    assert agg["p"]["vs_prefix_aware"]["ttft_p90_s"]["per_seed"] == [0.5, 1.0]
    assert agg["p"]["seeds"] == 2 and agg["rr"]["seeds"] == 1
    assert agg["p"]["hit_rate"] == pytest.approx(0.25) and "n" not in agg["p"]


def test_b2b_stream_has_a_warm_up_phase_before_the_ramp():
    reqs, warm = stream(CASES["b2b"], 10.0, 60, seed=1)
    assert warm == 60 // (1 + len(RAMP)) and len(reqs) == warm * (1 + len(RAMP))
    gaps = [b.offset_s - a.offset_s for a, b in zip(reqs, reqs[1:])]
    # Arrivals speed up along the ramp: the last phase's mean gap is shorter than the warm-up's.
    assert sum(gaps[-warm + 1:]) < sum(gaps[:warm - 1])
    uniform, warm_u = stream(CASES["uniform"], 10.0, 50, seed=1)
    assert (len(uniform), warm_u) == (50, 5)
