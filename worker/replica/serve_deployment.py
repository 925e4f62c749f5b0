"""A Ray Serve replica that *is* a kvfleet replica (rank 0 of its tensor-parallel group), or
for the cost-model executor a host of several.

Serve keeps it alive: :meth:`ServeReplica.check_health` raises when a rank or the engine
thread is dead (or after a ``Worker.Drain``), and Serve replaces the replica; when Serve stops
it (scale-down, a new revision, shutdown) its async ``__del__`` drains it first, bounded by the
deployment's ``graceful_shutdown_timeout_s`` (set above the drain timeout by
:mod:`kvfleet.deploy.serve_app`). With tp > 1 the replica's placement group holds one bundle
per rank (``STRICT_PACK``); Serve puts this process in bundle 0 and
:class:`~kvfleet.worker.executor.tp.group.RankGroup` starts ranks 1..T-1 in the others.

Serve's own proxy and request path are unused: routers reach the replica's gRPC server,
found in the Redis registry, so Serve sees no load of its own: with ``--autoscale`` the
replica reports kvfleet's signals through ``record_autoscaling_stats`` and kvfleet's policy
(kvfleet.deploy.autoscale_serve) decides on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Optional

from kvfleet.config_codec import from_dict
from kvfleet.secrets import redis_url_from_env, telemetry_secrets_from_env
from kvfleet.worker.replica.load_report import combine  # torch-free

# Serve's application build step (a fresh process per deploy) imports this module for the
# class alone: torch and the engine are imported by the replica process, in __init__.
if TYPE_CHECKING:
    from kvfleet.worker.replica.replica import ReplicaConfig

log = logging.getLogger(__name__)


def replica_configs(base: ReplicaConfig, serve_replica: str, count: int) -> list[ReplicaConfig]:
    """The configs of the ``count`` kvfleet replicas one Serve replica hosts: ids
    ``{base id}-{serve replica}`` (``-{j}`` appended when ``count`` > 1)."""
    if count < 1:
        raise ValueError(f"replicas per Serve replica must be >= 1, got {count}")
    telemetry = base.telemetry
    if telemetry.metrics_port:  # a fixed port cannot be shared by every replica: free ports
        telemetry = dataclasses.replace(telemetry, metrics_port=0)
    stem = f"{base.replica_id}-{serve_replica}"
    return [dataclasses.replace(base, replica_id=stem if count == 1 else f"{stem}-{j}",
                                serve_replica=serve_replica, telemetry=telemetry)
            for j in range(count)]


def config_from_env(cfg: ReplicaConfig, env) -> ReplicaConfig:
    """``cfg`` with the secrets its args never carry (kvfleet.secrets) taken from ``env``: the
    Redis password and the OTLP headers. Raises ValueError for malformed OTLP headers."""
    return dataclasses.replace(cfg, redis_url=redis_url_from_env(cfg.redis_url, env),
                               telemetry=telemetry_secrets_from_env(cfg.telemetry, env))


class ServeReplica:
    """Serve deployment class (see :mod:`kvfleet.deploy.serve_app`).

    Args:
        replica: a :class:`ReplicaConfig` as a dict (``config_codec.to_dict``); its
            ``replica_id`` is the stem of the ids (the deployment's name).
        count: kvfleet replicas in this process (1 unless the executor is the cost model).
        revision: the operator's label of this rollout (a new one replaces every replica,
            one at a time); written to the log only.

    Raises:
        Whatever building a replica raises (a bad model dir, a tp the model cannot split):
        Serve then reports the deployment unhealthy with the message.
    """

    def __init__(self, replica: dict, count: int = 1, revision: str = "") -> None:
        from ray import serve

        from kvfleet.worker.replica.host import ThreadedHost
        from kvfleet.worker.replica.replica import ReplicaConfig

        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        me = serve.get_replica_context().replica_id.unique_id
        self.cfgs = replica_configs(config_from_env(from_dict(ReplicaConfig, replica),
                                                    os.environ), me, count)
        self._host = ThreadedHost(self.cfgs)
        try:
            self.addresses = self._host.start()
        except BaseException:
            self._host.close()
            raise
        self._stopped = False
        self._revision = revision
        log.info("Serve replica %s (revision %r): kvfleet replicas %s at %s", me, revision,
                 [c.replica_id for c in self.cfgs], self.addresses)

    def check_health(self) -> None:
        """Raises RuntimeError naming the failure when any hosted replica cannot serve."""
        for server in self._host.servers:
            why = server.healthy()
            if why is not None:
                raise RuntimeError(why)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, every metrics interval: the hosted replicas'
        signals (kvfleet.worker.replica.autoscale.SIGNALS), combined when several."""
        return await asyncio.wrap_future(self._host.submit(self._report()))

    async def _report(self) -> dict[str, float]:
        return combine(s.autoscale_report(self._revision) for s in self._host.servers)

    async def drain(self, timeout_s: Optional[float] = None) -> int:
        """Drain every hosted replica (see ``ReplicaServer.drain``); returns the sequences
        the drain timeout ended."""
        return await asyncio.wrap_future(self._host.submit(self._host.host.drain(timeout_s)))

    async def __del__(self) -> None:
        """Serve is stopping this replica: drain, then stop (idempotent)."""
        if getattr(self, "_stopped", True):
            return
        self._stopped = True
        try:
            await self.drain()
        except Exception:
            log.exception("drain before stop failed")
        await asyncio.get_running_loop().run_in_executor(None, self._host.close)
