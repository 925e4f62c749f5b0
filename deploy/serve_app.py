"""kvfleet's worker replicas as one Ray Serve application per served model.

:func:`build` is the application builder Serve imports (``kvfleet.deploy.serve_app:build``);
:func:`app_config` writes the declarative config the launcher applies
(:mod:`kvfleet.deploy.serve_control`). Everything Serve needs to place, watch and stop a
replica lives in the config's deployment entry, readable by an operator:

- ``placement_group_bundles``: with tp > 1 one bundle per rank under ``STRICT_PACK`` (Serve puts
  the replica, rank 0, in bundle 0; it starts ranks 1..T-1 in the others);
- ``health_check_period_s`` / ``health_check_timeout_s``: ``check_health`` fails on a dead rank
  or engine thread, and a replica that stops answering is replaced too;
- ``graceful_shutdown_timeout_s``: above the drain timeout, so Serve's force-kill never cuts a
  drain short;
- ``max_surge_percent``: a rollout (new ``args``: a revision, a model directory) starts each
  replacement before the old replica it replaces stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvfleet.allocator.units import cdiv
from kvfleet.config_codec import to_dict
from kvfleet.deploy.serve_control import DEPLOYMENT, IMPORT_PATH, app_name

# Serve imports this module in a fresh process for every deploy (its build step): keep it
# free of torch (the replica module imports it): torch's import would add to every start.
if TYPE_CHECKING:
    from kvfleet.worker.replica.replica import ReplicaConfig

SHUTDOWN_MARGIN_S = 15.0  # graceful_shutdown_timeout_s - drain timeout: the stop after a drain


@dataclass(frozen=True)
class Placement:
    """Ray resources of one Serve replica: ``num_cpus`` for rank 0, ``rank_bundle`` for each
    of ranks 1..T-1 (``{"GPU": 1}`` on CUDA, a small CPU share otherwise)."""

    num_cpus: float
    tensor_parallel_size: int = 1
    cuda: bool = False
    rank_num_cpus: float = 0.05

    def bundles(self) -> Optional[list[dict]]:
        """One bundle per rank (rank 0 first), or None at tp=1 (no placement group)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return None
        gpu = {"GPU": 1.0} if self.cuda else {}
        rest = gpu or {"CPU": self.rank_num_cpus}
        # The replica's CPU share covers all its ranks (tp=4 must still place on 2 cores).
        first = {"CPU": max(self.num_cpus - (tp - 1) * rest.get("CPU", 0), 0.01), **gpu}
        return [first] + [rest] * (tp - 1)

    def actor_options(self) -> dict:
        bundles = self.bundles()
        cpus = bundles[0]["CPU"] if bundles else self.num_cpus
        return {"num_cpus": cpus, "num_gpus": 1 if self.cuda else 0}


def app_config(replica: ReplicaConfig, num_replicas: int, placement: Placement,
               per_host: int = 1, revision: str = "", env: Optional[dict] = None,
               health_check_period_s: float = 1.0, health_check_timeout_s: float = 10.0,
               autoscaling: Optional[dict] = None) -> dict:
    """The declarative config (``ServeApplicationSchema`` fields) of ``replica.model_name``'s
    application: ``num_replicas`` kvfleet replicas, ``per_host`` to a Serve replica (the
    cost-model executor; 1 otherwise). ``replica.replica_id`` is the stem of the replicas'
    ids. ``env``: environment variables of every replica process. ``autoscaling``: the
    deployment's ``autoscaling_config`` (kvfleet.deploy.autoscale_serve), which then sets the
    count instead of ``num_replicas``.

    Raises ValueError for ``num_replicas`` or ``per_host`` < 1."""
    if num_replicas < 1 or per_host < 1:
        raise ValueError(f"replicas ({num_replicas}) and per_host ({per_host}) must be >= 1")
    per_host = min(per_host, num_replicas)
    deployment = {
        "name": DEPLOYMENT,
        "num_replicas": cdiv(num_replicas, per_host),
        "ray_actor_options": placement.actor_options(),
        "health_check_period_s": health_check_period_s,
        "health_check_timeout_s": health_check_timeout_s,
        "graceful_shutdown_timeout_s": replica.drain_timeout_s + SHUTDOWN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 0.1,  # Serve's own requests: none (routers use gRPC)
        # A rollout starts a new replica (registered, serving) before an old one stops and
        # drains: 1 % of the target, rounded up: one at a time for up to 100 replicas.
        "max_surge_percent": 1,
    }
    if autoscaling is not None:
        del deployment["num_replicas"]
        deployment["autoscaling_config"] = autoscaling
    bundles = placement.bundles()
    if bundles:
        deployment["placement_group_bundles"] = bundles
        deployment["placement_group_strategy"] = "STRICT_PACK"
    return {
        "name": app_name(replica.namespace, replica.model_name),
        "route_prefix": None,
        "import_path": IMPORT_PATH,
        "runtime_env": {"env_vars": dict(env or {})},
        "args": {"replica": to_dict(replica), "count": per_host, "revision": revision},
        "deployments": [deployment],
    }


def build(args: dict):
    """Serve's application builder: the worker deployment bound to ``args`` (see
    :func:`app_config`)."""
    from ray import serve

    from kvfleet.worker.replica.serve_deployment import ServeReplica

    return serve.deployment(name=DEPLOYMENT)(ServeReplica).bind(
        args["replica"], int(args.get("count", 1)), str(args.get("revision", "")))
