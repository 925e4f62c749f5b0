"""kvfleet's autoscaling policy plugged into Ray Serve's own autoscaler.

The replicas report their signals through ``record_autoscaling_stats``
(kvfleet.worker.replica.load_report); Serve aggregates them over ``look_back_period_s`` and
calls :class:`KvfleetPolicy` (``AutoscalingConfig.policy``, built once with the operator's
targets as ``policy_kwargs``) with an ``AutoscalingContext`` on every control-loop tick. The
policy (kvfleet.worker.replica.autoscale.decide) returns a count; Serve applies its
``upscale_delay_s`` / ``downscale_delay_s`` and min/max to it and picks which replica stops
(each drains first). No loop of kvfleet's own runs.

The decision is logged when it changes, exported as the Ray metric ``kvfleet_autoscale_target``
(labels ``application`` and ``reason``; Prometheus shows it as
``ray_kvfleet_autoscale_target``) and recorded in Ray's internal KV for ``kvfleet status``
(:func:`read_decision`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from kvfleet.worker.replica.autoscale import (
    AutoscaleTargets,
    Decision,
    complete,
    decide,
    serve_reports,
)
from kvfleet.worker.replica.autoscale_clock import FleetClock

log = logging.getLogger("ray.serve")
POLICY_PATH = "kvfleet.deploy.autoscale_serve:KvfleetPolicy"
PUSH_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"
KV_NAMESPACE = "kvfleet"
RECORD_EVERY_S = 5.0  # the status record is rewritten at least this often


@dataclass(frozen=True)
class AutoscaleConfig:
    """``targets`` (what to hold) and Serve's own knobs: ``upscale_delay_s`` /
    ``downscale_delay_s`` (a decision must persist this long before Serve applies it: the
    scale-down delay is what makes the policy's margin a sustained one),
    ``look_back_period_s`` (the window Serve averages each signal over) and
    ``metrics_interval_s`` (how often each replica reports).

    Raises ValueError naming the flag for a delay < 0 or a period <= 0, or the look-back
    window not longer than the metrics interval."""

    targets: AutoscaleTargets
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 12.0
    metrics_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("--upscale-delay and --downscale-delay must be >= 0 seconds")
        if not 0 < self.metrics_interval_s < self.look_back_period_s:
            raise ValueError(f"metrics_interval_s ({self.metrics_interval_s:g} s) must be > 0 and "
                             f"below look_back_period_s ({self.look_back_period_s:g} s)")

    def serve_config(self) -> dict:
        """The deployment's ``autoscaling_config`` (``AutoscalingConfig`` fields).

        ``metrics_interval_s`` is set although Serve calls it deprecated: Serve 2.60's
        replicas still push their metrics to the controller every ``metrics_interval_s``
        (default 10 s) and ignore :data:`PUSH_INTERVAL_ENV`. Left out, the controller sees
        a report every 10 s that holds only the last ``look_back_period_s`` of samples."""
        t = self.targets
        return {"min_replicas": t.min_replicas, "initial_replicas": t.min_replicas,
                "max_replicas": t.max_replicas, "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
                "metrics_interval_s": self.metrics_interval_s,
                "policy": {"policy_function": POLICY_PATH, "policy_kwargs": t.to_kwargs()}}

    def env(self) -> dict[str, str]:
        """Replica environment: Serve's replica metrics push interval (the variable later
        Serve releases read instead of ``metrics_interval_s``)."""
        return {PUSH_INTERVAL_ENV: f"{self.metrics_interval_s:g}"}


def decision_key(app_name: str) -> bytes:
    """Ray internal-KV key of an application's last decision."""
    return f"autoscale:{app_name}".encode()


class KvfleetPolicy:
    """Serve's policy callable: ``__call__(ctx) -> (target replicas, policy state)``.
    ``kwargs``: :class:`AutoscaleTargets` fields (``AutoscaleTargets.to_kwargs``)."""

    def __init__(self, **kwargs: Any) -> None:
        self.targets = AutoscaleTargets(**kwargs)
        self._last: Optional[tuple[int, str]] = None
        self._recorded_at = 0.0
        self._reasons: set[str] = set()
        self._gauge: Any = None
        self._last_change: Optional[dict] = None  # the last decision that moved the target
        self._clock: Optional[FleetClock] = None

    def __call__(self, ctx) -> tuple[int, dict]:
        reports = serve_reports(ctx.aggregated_metrics, ctx.running_replicas)
        if self._clock is None:
            look_back = getattr(getattr(ctx, "config", None), "look_back_period_s", 0.0)
            self._clock = FleetClock(float(look_back or 0.0))
        current, target = ctx.current_num_replicas, ctx.target_num_replicas
        clocks = self._clock.observe(current, target, complete(current, reports),
                                     time.monotonic())
        d = decide(self.targets, current, target, reports, clocks)
        try:
            self._publish(ctx, d)
        except Exception:  # observability must never stop Serve's control loop
            log.exception("kvfleet autoscale: publishing the decision failed")
        return d.target, {"kvfleet_reason": d.reason}

    def _publish(self, ctx, d: Decision) -> None:
        now = time.time()
        changed = self._last != (d.target, d.reason)
        if d.target != ctx.target_num_replicas:
            self._last_change = {"from": ctx.target_num_replicas, "to": d.target,
                                 "reason": d.reason, "at": now}
        if changed:
            log.info("kvfleet autoscale %s: target %d (running %d) reason %s: %s", ctx.app_name,
                     d.target, ctx.current_num_replicas, d.reason, d.detail)
            self._set_gauge(ctx.app_name or "", d)
        from ray.experimental import internal_kv

        if internal_kv._internal_kv_initialized() and (
                changed or now - self._recorded_at >= RECORD_EVERY_S):

            record = {"target": d.target, "current": ctx.current_num_replicas,
                      "reason": d.reason, "detail": d.detail, "pressure": round(d.pressure, 3),
                      "at": now, "min": self.targets.min_replicas,
                      "max": self.targets.max_replicas, "last_change": self._last_change}
            internal_kv._internal_kv_put(decision_key(ctx.app_name or ""), json.dumps(record),
                                         overwrite=True, namespace=KV_NAMESPACE)
            self._recorded_at = now
        self._last = (d.target, d.reason)

    def _set_gauge(self, app: str, d: Decision) -> None:
        """The target on the series of the current reason; earlier reasons' series read 0."""
        if self._gauge is None:
            from ray.util import metrics

            self._gauge = metrics.Gauge(
                "kvfleet_autoscale_target",
                description="kvfleet's autoscaling target (replicas) on the series of the "
                            "reason of the last decision; other reasons read 0",
                tag_keys=("application", "reason"))
        for reason in self._reasons - {d.reason}:
            self._gauge.set(0, tags={"application": app, "reason": reason})
        self._reasons.add(d.reason)
        self._gauge.set(d.target, tags={"application": app, "reason": d.reason})


def read_decision(app_name: str) -> Optional[dict]:
    """The last decision :class:`KvfleetPolicy` recorded for ``app_name`` (target, current,
    reason, detail, pressure, at = Unix time, last_change = the last one that asked for a
    new count: from, to, reason, at), or None (not autoscaled, or no decision yet).
    Needs a connected Ray driver."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(decision_key(app_name), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None
