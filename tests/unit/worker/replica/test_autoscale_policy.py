"""kvfleet's autoscaling policy on synthetic reports and synthetic Serve contexts: track the
throughput load to its target (up at once by what it needs, down only with the band to
spare), one more replica near the SLO or above the KV target (a lagging p90
only once the count has held its window), hold in the band, never below MIN or above MAX,
no scale-down during a rollout or with replicas' signals missing, a replica that never starts
taken as not coming; and through Serve's own wrapper (delays, bounds), as the controller
runs it."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from kvfleet.deploy.autoscale_serve import POLICY_PATH, AutoscaleConfig, KvfleetPolicy
from kvfleet.worker.replica import autoscale as a
from kvfleet.worker.replica.autoscale import LATENCY_WINDOW_S, AutoscaleTargets, decide, serve_reports
from kvfleet.worker.replica.autoscale_clock import Clocks, FleetClock

T = AutoscaleTargets(min_replicas=1, max_replicas=6, slo_ttft_s=1.0, slo_itl_s=0.2,
                     target_kv_utilisation=0.8)


def report(delay=0.0, ttft=0.0, itl=0.0, kv=0.0, load=0.0, running=0, waiting=0, revision=0.0):
    return {a.QUEUE_DELAY_S: delay, a.TTFT_P90_S: ttft, a.ITL_P90_S: itl,
            a.KV_BLOCKS_USED: kv * 100, a.KV_BLOCKS_TOTAL: 100.0, a.RUNNING: running,
            a.WAITING: waiting, a.PREFILL_TOKENS_QUEUED: 0.0, a.PREFIX_HIT_RATE: 0.5,
            a.MAX_NUM_SEQS: 16.0, a.REVISION_ID: revision, a.THROUGHPUT_LOAD: load}


def fleet(n, **signals):
    return {f"r{i}": report(**signals) for i in range(n)}


@pytest.mark.parametrize("signals, reason", [
    (dict(delay=0.9), "queue_delay"), (dict(ttft=0.85), "ttft_p90"),
    (dict(itl=0.19), "itl_p90"), (dict(kv=0.7), "kv_utilisation")])
def test_each_signal_near_its_target_scales_up_naming_it(signals, reason):
    d = decide(T, 2, 2, fleet(2, **signals))
    assert d.target == 3 and d.reason == reason and d.pressure >= T.headroom


def test_a_latency_past_the_headroom_asks_for_one_more_never_in_proportion():
    # Neither a p90 nor a predicted queue is linear in the count: a step in proportion to
    # one overshoots (and the band then takes the replicas back: a sawtooth).
    for signals in (dict(ttft=1.6), dict(ttft=20.0), dict(delay=5.0), dict(itl=1.0)):
        assert decide(T, 2, 2, fleet(2, **signals)).target == 3, signals
    assert decide(T, 6, 6, fleet(6, ttft=20.0)).reason == "at_max"


def test_a_lagging_p90_counts_only_once_the_count_has_held_its_window():
    # Right after a change the p90s still hold the requests the last step answered.
    early = decide(T, 3, 3, fleet(3, ttft=1.2), Clocks(settled_s=LATENCY_WINDOW_S / 2))
    assert (early.target, early.reason) == (3, "within_band")
    assert decide(T, 3, 3, fleet(3, ttft=1.2), Clocks(settled_s=LATENCY_WINDOW_S)).target == 4
    # The predicted queue delay is now, not lagging: it acts at once.
    assert decide(T, 3, 3, fleet(3, delay=1.2), Clocks(settled_s=0.0)).reason == "queue_delay"


def test_fleet_clock_times_pending_replicas_the_settled_count_and_missing_reports():
    clock = FleetClock(look_back_s=12.0)
    inf = float("inf")
    assert clock.observe(2, 2, True, 100.0) == Clocks(0.0, inf, 0.0)  # no earlier count
    assert clock.observe(2, 3, True, 110.0) == Clocks(0.0, inf, 0.0)
    assert clock.observe(2, 3, False, 150.0) == Clocks(40.0, inf, 0.0)
    assert clock.observe(2, 4, False, 160.0) == Clocks(0.0, inf, 10.0)  # a new target: a new wait
    assert clock.observe(3, 4, True, 170.0) == Clocks(10.0, -12.0, 0.0)  # seen through the look-back
    assert clock.observe(4, 4, True, 200.0) == Clocks(0.0, -12.0, 0.0)
    assert clock.observe(4, 4, True, 250.0) == Clocks(0.0, 38.0, 0.0)


def test_a_replica_that_never_starts_does_not_block_scale_in():
    quiet = fleet(2, load=0.1)
    d = decide(T, 2, 3, quiet, Clocks(pending_s=10.0))  # still starting: wait for it
    assert (d.target, d.reason) == (3, "starting")
    d = decide(T, 2, 3, quiet, Clocks(pending_s=T.start_timeout_s))
    assert (d.target, d.reason) == (1, "not_placed") and "not running" in d.detail
    d = decide(T, 2, 3, fleet(2), Clocks(pending_s=T.start_timeout_s))  # at MIN 1 already light
    assert d.target == 1
    # Still needed: the ask stands (a cluster autoscaler may yet place it).
    busy = fleet(2, load=1.0)
    assert decide(T, 2, 3, busy, Clocks(pending_s=T.start_timeout_s)).target == 3


def test_no_second_step_while_the_first_one_starts():
    d = decide(T, 2, 4, fleet(2, ttft=1.6))  # Serve is already starting 2 more
    assert (d.target, d.reason) == (4, "starting")
    assert decide(T, 2, 4, fleet(2)).target == 4  # quiet meanwhile: no scale-down either


def test_hysteresis_band_holds_and_margin_scales_down():
    assert decide(T, 3, 3, fleet(3, ttft=0.6)).reason == "within_band"  # latency in the band
    d = decide(T, 3, 3, fleet(3, ttft=0.2, itl=0.02, kv=0.1, load=0.3))
    assert (d.target, d.reason) == (2, "sustained_margin")
    # KV spread over one fewer would cross the margin: hold.
    assert decide(T, 2, 2, fleet(2, kv=0.25)).reason == "within_band"


def test_load_is_tracked_to_its_target_up_at_once_and_by_what_it_needs():
    t = AutoscaleTargets(min_replicas=1, max_replicas=8, slo_ttft_s=1.0, target_load=0.5)
    assert decide(t, 2, 2, fleet(2, load=0.5)).reason == "within_band"  # at the target: hold
    d = decide(t, 2, 2, fleet(2, load=0.9))  # 2 × 0.9 / 0.5 = 3.6 replicas' worth
    assert (d.target, d.reason) == (4, "load")
    assert decide(t, 2, 2, fleet(2, load=1.4)).target == 6  # saturated + queue: a big step


def test_load_scales_down_only_with_the_band_to_spare_and_by_as_many_as_that_allows():
    t = AutoscaleTargets(min_replicas=1, max_replicas=8, slo_ttft_s=1.0, target_load=0.5,
                         load_band=0.2)
    # 4 at 0.35: one fewer runs each at 0.47, above the 0.4 the band allows: hold.
    assert decide(t, 4, 4, fleet(4, load=0.35)).reason == "within_band"
    d = decide(t, 4, 4, fleet(4, load=0.28))  # 3 survivors at 0.37 each
    assert (d.target, d.reason) == (3, "sustained_margin")
    assert decide(t, 6, 6, fleet(6, load=0.1)).target == 2  # night: 6 → 2 in one decision
    # Latency at the margin forbids it however light the load.
    assert decide(t, 6, 6, fleet(6, load=0.1, ttft=0.45)).reason == "within_band"


def test_never_below_min_and_targets_outside_the_bounds_are_clamped():
    t = AutoscaleTargets(min_replicas=2, max_replicas=4, slo_ttft_s=1.0)
    assert decide(t, 2, 2, fleet(2)).target == 2 and decide(t, 2, 2, fleet(2)).reason == "at_min"
    assert decide(t, 5, 5, {}).target == 4


def test_a_rollout_holds_scale_down_but_not_scale_up():
    quiet = {"old": report(revision=1.0), "new": report(revision=2.0)}
    d = decide(T, 2, 2, quiet)
    assert (d.target, d.reason) == (2, "rollout")
    busy = {"old": report(load=1.0, revision=1.0), "new": report(load=1.0, revision=2.0)}
    d = decide(T, 2, 2, busy)
    assert (d.target, d.reason) == (3, "load")  # 2 × 1.0 / 0.7
    assert decide(T, 3, 3, {}).reason == "no_metrics"


def test_replicas_missing_signals_are_named_and_hold_scale_down():
    reports = fleet(3)
    del reports["r2"][a.TTFT_P90_S]
    d = decide(T, 3, 3, reports)
    assert (d.target, d.reason) == (3, "missing_metrics") and "r2" in d.detail
    d = decide(T, 3, 3, fleet(2))  # a running replica has not reported at all
    assert (d.target, d.reason) == (3, "missing_metrics") and "2 of 3" in d.detail
    partial = fleet(3, load=1.2)
    del partial["r0"][a.THROUGHPUT_LOAD]
    assert decide(T, 3, 3, partial).target == 6  # the others' mean still scales up
    # A replica that never reports does not hold scale-in for ever either.
    quiet = fleet(2)
    d = decide(T, 3, 3, quiet, Clocks(missing_s=T.start_timeout_s))
    assert (d.target, d.reason) == (1, "sustained_margin") and "2 of 3" in d.detail


def test_kv_only_target_ignores_latency():
    t = AutoscaleTargets(min_replicas=1, max_replicas=3, target_kv_utilisation=0.5)
    assert decide(t, 1, 1, fleet(1, ttft=50.0, kv=0.1)).reason == "at_min"
    assert decide(t, 1, 1, fleet(1, kv=0.45)).reason == "kv_utilisation"


@pytest.mark.parametrize("kwargs, flag", [
    (dict(min_replicas=3, max_replicas=2, slo_ttft_s=1.0), "MIN"),
    (dict(min_replicas=0, max_replicas=2, slo_ttft_s=1.0), "MIN"),
    (dict(min_replicas=1, max_replicas=2, slo_ttft_s=0.0), "--slo-ttft-ms"),
    (dict(min_replicas=1, max_replicas=2, slo_itl_s=-1.0), "--slo-itl-ms"),
    (dict(min_replicas=1, max_replicas=2, target_kv_utilisation=1.5), "--target-kv-utilisation"),
    (dict(min_replicas=1, max_replicas=2, slo_ttft_s=1.0, target_load=0.0), "--target-load"),
    (dict(min_replicas=1, max_replicas=2, slo_ttft_s=1.0, load_band=1.0), "load_band"),
    (dict(min_replicas=1, max_replicas=2), "needs a target")])
def test_bad_targets_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        AutoscaleTargets(**kwargs)


def context(policy_config: AutoscalingConfig, current: int, target: int, reports: dict,
            state: dict, now: float) -> AutoscalingContext:
    """An AutoscalingContext as Serve's controller builds one (aggregated_metrics: signal →
    replica → value)."""
    ids = [ReplicaID(rid, DeploymentID("KvfleetReplica", "app")) for rid in reports]
    metrics = {name: {rid: reports[rid.unique_id][name] for rid in ids} for name in a.SIGNALS}
    return AutoscalingContext(
        deployment_id=ids[0].deployment_id if ids else DeploymentID("KvfleetReplica", "app"),
        deployment_name="KvfleetReplica", app_name="app", current_num_replicas=current,
        target_num_replicas=target, running_replicas=ids, total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=policy_config.min_replicas,
        capacity_adjusted_max_replicas=policy_config.max_replicas, policy_state=state,
        last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=policy_config)


def test_serve_runs_the_policy_with_its_delays_and_bounds(monkeypatch):
    cfg = AutoscaleConfig(AutoscaleTargets(1, 3, slo_ttft_s=1.0), upscale_delay_s=0.0,
                          downscale_delay_s=30.0)
    serve_cfg = AutoscalingConfig(**cfg.serve_config())
    assert serve_cfg.policy.policy_function == POLICY_PATH
    policy = _apply_autoscaling_config(KvfleetPolicy(**serve_cfg.policy.policy_kwargs))
    clock = [1000.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    target, state = policy(context(serve_cfg, 1, 1, fleet(1, ttft=1.2), {}, clock[0]))
    assert target == 2 and state["kvfleet_reason"] == "ttft_p90"  # no upscale delay
    quiet = fleet(2, ttft=0.1)
    target, state = policy(context(serve_cfg, 2, 2, quiet, state, clock[0]))
    assert target == 2 and state["kvfleet_reason"] == "sustained_margin"  # delay running
    clock[0] += 31.0
    target, state = policy(context(serve_cfg, 2, 2, quiet, state, clock[0]))
    assert target == 1  # the margin held for downscale_delay_s


def test_serve_gives_back_a_replica_that_never_starts_once_the_load_left(monkeypatch):
    # `--autoscale 1..3` where a third replica cannot be placed: Serve's target stays 3 while
    # 2 run; once the load has gone the policy must still bring the fleet down.
    cfg = AutoscaleConfig(AutoscaleTargets(1, 3, slo_ttft_s=1.0), upscale_delay_s=0.0,
                          downscale_delay_s=0.0)
    serve_cfg = AutoscalingConfig(**cfg.serve_config())
    policy = _apply_autoscaling_config(KvfleetPolicy(**serve_cfg.policy.policy_kwargs))
    clock = [1000.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    state: dict = {}
    for _ in range(3):  # the load is gone, the third replica still pending: wait for it
        target, state = policy(context(serve_cfg, 2, 3, fleet(2), state, clock[0]))
        assert target == 3 and state["kvfleet_reason"] == "starting"
        clock[0] += 30.0
    clock[0] += AutoscaleTargets.start_timeout_s
    target, state = policy(context(serve_cfg, 2, 3, fleet(2), state, clock[0]))
    assert target == 1 and state["kvfleet_reason"] == "not_placed"


def test_serve_reports_keep_replicas_missing_a_signal_with_what_they_reported():
    ids = [ReplicaID("a", DeploymentID("d", "x")), ReplicaID("b", DeploymentID("d", "x"))]
    full = {name: {ids[0]: 1.0, ids[1]: 2.0} for name in a.SIGNALS}
    del full[a.TTFT_P90_S][ids[1]]
    got = serve_reports(full, ids)
    assert list(got) == ["a", "b"] and a.TTFT_P90_S not in got["b"]
    assert serve_reports(None, ids) == {}


def test_a_full_queue_scales_up_before_latency_climbs():
    d = decide(T, 2, 2, fleet(2, load=1.25))  # seats full, a quarter of them again queued
    assert (d.target, d.reason) == (4, "load")  # 2 × 1.25 / 0.7
