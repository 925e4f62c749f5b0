"""The autoscaling benches' pure parts: the wall-clock ramp and its 10 s windows, the simulated
day's arrivals, its initial replicas and the clairvoyant fleet's replica-hours, and which
replicas the simulated fleet stops on a scale-down."""

from __future__ import annotations

import argparse

import pytest

from bench.sim.autoscale_sim import Day, ideal_vs_peak, initial_replicas, poisson_arrivals
from bench.cluster.autoscale_wall import ramp, windows
from bench.sim.elastic_fleet import ElasticFleet, Replica
from bench.common.load import Result
from bench.common.workload import Request

RAMP = argparse.Namespace(low=0.1, up_s=10.0, hold_s=5.0, down_s=10.0)


def test_ramp_goes_up_holds_and_comes_back_down():
    assert ramp(0.0, RAMP, 10.0) == pytest.approx(1.0)
    assert ramp(5.0, RAMP, 10.0) == pytest.approx(5.5)
    assert ramp(12.0, RAMP, 10.0) == 10.0
    assert ramp(20.0, RAMP, 10.0) == pytest.approx(5.5)
    assert ramp(99.0, RAMP, 10.0) == pytest.approx(1.0)


def test_windows_take_the_last_sample_and_the_ttft_p99_of_requests_sent():
    req = Request(0, 0, (1, 2), 0.0)
    ok = Result(req, sent=1.0, first=1.5, done=2.0)
    slow = Result(req, sent=2.0, first=4.0, done=5.0)
    failed = Result(req, sent=12.0, error="UNAVAILABLE")
    timeline = [{"t": 0.5, "target": 1, "serving": 1, "reason": "at_min"},
                {"t": 9.5, "target": 2, "serving": 1, "reason": "load"},
                {"t": 15.0, "target": 2, "serving": 2, "reason": "starting"}]
    rows = windows([ok, slow, failed], timeline)
    assert [(r["target"], r["serving"], r["reason"]) for r in rows] == [
        (2, 1, "load"), (2, 2, "starting")]
    assert rows[0]["ttft_p99_ms"] == pytest.approx(2000.0) and rows[0]["requests"] == 2
    assert rows[1]["failed"] == 1 and rows[1]["ttft_p99_ms"] is None


def test_arrivals_follow_the_rate_and_the_clairvoyant_floor_lies_between_min_and_max():
    day = Day(day_s=600.0, peak_rps=20.0, seed=3)
    arrivals = poisson_arrivals(day.rate, 30.0, 600.0, seed=3)
    expected = sum(day.rate(t / 10) for t in range(6000)) / 10
    assert len(arrivals) == pytest.approx(expected, rel=0.05)
    assert arrivals == sorted(arrivals) and day.arrivals() == arrivals
    floor = ideal_vs_peak(day, capacity=10.0, lo=1, hi=4, load=0.7, step_s=1.0)
    assert 1 / 4 < floor < 1.0
    assert ideal_vs_peak(day, 10.0, 1, 4, 1.0, step_s=1.0) < floor  # hotter replicas: fewer


def test_initial_replicas_are_what_midnights_load_needs_within_the_bounds():
    day = Day(day_s=600.0, peak_rps=20.0)  # midnight: 0.317 of the peak, 6.3 requests/s
    assert initial_replicas(day, capacity=10.0, lo=1, hi=8) == 1  # 0.9 replicas' worth at 0.7
    assert initial_replicas(day, capacity=2.0, lo=1, hi=8) == 5  # 4.5
    assert initial_replicas(day, capacity=2.0, lo=1, hi=4) == 4


def test_a_scale_down_stops_the_newest_idle_ones_at_once_and_drains_the_busy_ones():
    # The fleet's bookkeeping only (no engines are built): Serve stops the newest replicas.
    fleet = ElasticFleet.__new__(ElasticFleet)
    fleet.clock = 50.0
    fleet.replicas = {rid: Replica(rid, t, t + 7.0) for rid, t in
                      (("r0", 0.0), ("r1", 10.0), ("r2", 20.0), ("r3", 45.0))}
    fleet.engines = dict.fromkeys(("r0", "r1", "r2"))  # r3 is still starting
    fleet.inflight = {"r0": 3, "r1": 2, "r2": 0}
    fleet.busy = {"r0": True, "r1": True, "r2": False}
    fleet.set_target(1)
    r = fleet.replicas
    assert [x.draining for x in r.values()] == [False, True, True, True]
    assert (r["r1"].stopped, r["r2"].stopped, r["r3"].stopped) == (None, 50.0, 50.0)
