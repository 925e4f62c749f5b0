"""The step-cost calibration shared through the cluster's Redis, so a fresh replica (a new
pod, with an empty disk cache) does not time its own steps when another replica of the same
:class:`~kvfleet.worker.step_cost.calibration.CalibrationKey` already did.

The key names the model, the device (processor model and the CPUs the process may use under
its cgroup quota, or the CUDA device), tp, dtype and threads: replicas that share one run the
same steps at the same speed, up to the noise the engine's online correction absorbs
(``StepCost.observe``). Redis is an index here as everywhere: a missing, unreadable or
unreachable entry costs one calibration, never a failed start.
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Optional

import redis

from kvfleet.worker.step_cost.calibration import CalibrationKey
from kvfleet.worker.step_cost.model import CostModel

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # a Redis that does not answer within this costs a calibration, not a start


def step_cost_key(namespace: str, key: CalibrationKey) -> str:
    """The Redis key of ``key``'s calibration under ``namespace``."""
    return f"{namespace}step_cost:{key.digest()}"


def shared_or_calibrate(redis_url: Optional[str], namespace: str, key: CalibrationKey,
                        calibrate: Callable[[], CostModel]) -> CostModel:
    """The calibration another replica stored for ``key``, else ``calibrate()``'s (stored
    for the next one). ``redis_url`` None: ``calibrate()`` alone."""
    if not redis_url:
        return calibrate()
    name = step_cost_key(namespace, key)
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=TIMEOUT_S,
                                      socket_connect_timeout=TIMEOUT_S)
    except ValueError as exc:  # a malformed URL: the replica's own start reports it
        log.warning("step-cost calibration not shared (%s)", exc)
        return calibrate()
    with client:
        shared = _read(client, name, key)
        if shared is not None:
            log.info("step cost from the calibration shared in Redis (%s): %s", name, shared)
            return shared
        cost = calibrate()
        try:
            client.set(name, json.dumps({"key": key.fields(), "cost_model": cost.to_json()}))
        except redis.RedisError as exc:
            log.warning("step-cost calibration not shared (%s)", exc)
        return cost


def _read(client: redis.Redis, name: str, key: CalibrationKey) -> Optional[CostModel]:
    try:
        raw = client.get(name)
    except redis.RedisError as exc:
        log.warning("shared step-cost calibration unreadable (%s): calibrating", exc)
        return None
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        if data.get("key") == key.fields():
            return CostModel.from_json(data["cost_model"], f"shared: {name}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("shared step-cost calibration %s unreadable (%s): calibrating", name, exc)
    return None
