"""Replicas of one process on one asyncio loop of their own.

A cost-model replica's forward is a sleep, so dozens of them fit in one process: each keeps its
own engine thread, gRPC server, block pool and Redis publisher, exactly as when alone. A
model replica is a host of one. :class:`ThreadedHost` runs the host's loop in a background
thread, so the Ray Serve replica (:mod:`kvfleet.worker.replica.serve_deployment`) calls it from any loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Optional, Sequence

from kvfleet.worker.replica.replica import ReplicaConfig, ReplicaServer


class ReplicaHost:
    """Builds, starts, drains and stops a list of :class:`ReplicaServer` on the running loop."""

    def __init__(self, cfgs: Sequence[ReplicaConfig]) -> None:
        self.cfgs = list(cfgs)
        self.servers: list[ReplicaServer] = []

    async def start(self) -> list[str]:
        """Start every replica; returns their gRPC addresses in order."""
        self.servers = [ReplicaServer(cfg) for cfg in self.cfgs]
        return list(await asyncio.gather(*(s.start() for s in self.servers)))

    async def drain(self, timeout_s: Optional[float] = None) -> int:
        """Drain every replica at once (see :meth:`ReplicaServer.drain`); returns the
        sequences the drain timeout ended, summed."""
        return sum(await asyncio.gather(*(s.drain(timeout_s) for s in self.servers)))

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)
        self.servers = []


class ThreadedHost:
    """A :class:`ReplicaHost` on its own event loop thread; methods block or return futures."""

    def __init__(self, cfgs: Sequence[ReplicaConfig]) -> None:
        self.host = ReplicaHost(cfgs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-host-io",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the host's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def start(self, timeout_s: float = 600.0) -> list[str]:
        """Start every replica; returns their gRPC addresses ``host:port`` in order."""
        return self.submit(self.host.start()).result(timeout_s)

    @property
    def servers(self) -> list[ReplicaServer]:
        return self.host.servers

    def close(self) -> None:
        """Stop every replica (no drain) and the loop thread; idempotent."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self.submit(self.host.stop()).result(60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()
