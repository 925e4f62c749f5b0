"""Serve's autoscaler running kvfleet's policy on what the replicas report: load fills the
sequence slots of one cost-model replica (throughput load above its target) and Serve adds a
second; the load stops and, the margin held for the downscale delay, Serve goes back to one.
No request fails. Short intervals (metrics every 0.5 s, look-back 4 s, delays 0 / 2 s) keep it
to seconds; each phase waits on the reported metrics and the decisions, so a loaded machine
only makes it slower."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from kvfleet.deploy import serve_control
from kvfleet.deploy.autoscale_serve import AutoscaleConfig, read_decision
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.router.config import RouterConfig
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel
from kvfleet.worker.replica.autoscale import AutoscaleTargets
from tests.fixtures.cluster import cluster_with_client, tiny_replica

UP = {"load", "queue_delay", "ttft_p90"}
BOUND_S = 180.0  # liveness bound per phase (never reached when healthy; a loaded suite is slow)


def _wait(app: str, done: Callable[[Optional[dict], Optional[int]], bool],
          seen: set[str]) -> bool:
    """Poll the policy's recorded decision and Serve's target until ``done(decision,
    target)``; collects every reason seen. False after :data:`BOUND_S`."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        decision = read_decision(app)
        if decision:
            seen.add(decision["reason"])
            if decision.get("last_change"):
                seen.add(decision["last_change"]["reason"])
        if done(decision, serve_control.target_replicas(app)):
            return True
        time.sleep(0.2)
    return False


def _judged_reports(decision: Optional[dict], _target: Optional[int]) -> bool:
    """The policy has decided on replicas' reports (metrics reached Serve's controller)."""
    return bool(decision) and decision["reason"] != "no_metrics"


def test_reported_metrics_scale_one_replica_up_and_back_down(ray_session, redis_server,
                                                             tiny_llama_dir) -> None:
    replica = tiny_replica(tiny_llama_dir, redis_server.url, "kvtest-auto:",
                           executor="cost-model", cost_model=CostModel(0.02, 0.0005, 0.005),
                           drain_timeout_s=5.0,
                           scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128))
    # Six clients on two seats: throughput load 3 (seats full, twice as many queued) asks for a
    # second replica. The SLO is loose so that the TTFT p90 of the loaded spell (kept 30 s)
    # does not hold the scale-down: the load alone decides both ways.
    auto = AutoscaleConfig(AutoscaleTargets(1, 2, slo_ttft_s=10.0), upscale_delay_s=0.0,
                           downscale_delay_s=2.0, look_back_period_s=4.0, metrics_interval_s=0.5)
    cfg = ClusterConfig(replica, RouterConfig(port=0), replicas=1, autoscale=auto,
                        replica_num_cpus=0.25)
    with cluster_with_client(cfg) as (cluster, client):
        app = cluster.app_name
        assert app is not None and serve_control.target_replicas(app) == 1
        stop, failed, done = threading.Event(), [], []

        def load() -> None:
            while not stop.is_set():
                try:
                    client.generate("the autoscaler test", max_tokens=16, ignore_eos=True,
                                    timeout=60)
                    done.append(1)
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    failed.append(repr(exc))

        threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        seen: set[str] = set()
        try:
            # Each phase waits on what the replicas reported, not on a clock: first their
            # metrics reach the policy, then it asks for a second replica, then that serves.
            reported = _wait(app, _judged_reports, seen)
            # Serve's target can move before the policy's decision record is rewritten:
            # wait for both (the record's reason is what the scale-up is checked on).
            up = reported and _wait(app, lambda _d, target: target == 2 and bool(seen & UP), seen)
            if up:
                cluster.wait_serving(2, BOUND_S)
        finally:
            stop.set()
            for t in threads:
                t.join(70)
        assert reported, f"no replica metrics reached the policy; reasons seen: {seen}"
        assert up, f"no scale-up; reasons seen: {seen}"
        assert seen & UP, seen
        down = _wait(app, lambda _d, target: target == 1, seen)
        assert down and "sustained_margin" in seen, seen
        cluster.wait_serving(1, BOUND_S)
        assert failed == [] and done
