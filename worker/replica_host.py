"""Several replicas in one process, on one asyncio loop (cost-model fleets).

A cost-model replica's forward is a sleep, so dozens of them fit in one process: each keeps its
own engine thread, gRPC server, block pool and Redis publisher, exactly as when alone.
:class:`ReplicaHostActor` is the Ray actor ``kvfleet up --executor cost-model`` starts (one
per ``replicas_per_host`` replicas) instead of one :class:`~kvfleet.worker.ray_actor.ReplicaActor`
per replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Optional, Sequence

from kvfleet.worker.replica import ReplicaConfig, ReplicaServer


class ReplicaHost:
    """Builds, starts and stops a list of :class:`ReplicaServer` on the running loop."""

    def __init__(self, cfgs: Sequence[ReplicaConfig]) -> None:
        self.cfgs = list(cfgs)
        self.servers: list[ReplicaServer] = []

    async def start(self) -> list[str]:
        """Start every replica; returns their gRPC addresses in order."""
        self.servers = [ReplicaServer(cfg) for cfg in self.cfgs]
        return list(await asyncio.gather(*(s.start() for s in self.servers)))

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)
        self.servers = []


class ReplicaHostActor:
    """Wrap with ``ray.remote(num_cpus=…)(ReplicaHostActor)``; see :mod:`kvfleet.deploy.launcher`."""

    def __init__(self, cfgs: Sequence[ReplicaConfig]) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._host = ReplicaHost(cfgs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-host-io",
                                        daemon=True)
        self._thread.start()
        self._started = False

    def _run(self, coro, timeout_s: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> list[str]:
        """Start every replica; returns their gRPC addresses ``host:port`` in order."""
        addresses = self._run(self._host.start())
        self._started = True
        return addresses

    def metrics_addresses(self) -> list[Optional[str]]:
        return [s.metrics_address for s in self._host.servers]

    def stop(self) -> bool:
        """Deregister every replica and stop serving; safe to call twice."""
        if self._started:
            self._run(self._host.stop())
            self._started = False
        return True
