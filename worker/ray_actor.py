"""The Ray actor that hosts one replica: rank 0 of its tensor-parallel group (with tp > 1 it
starts ranks 1..T-1 itself, see :mod:`kvfleet.worker.parallel.group`).

The actor runs :class:`ReplicaServer` on its own asyncio loop in a background thread, so the
actor's methods stay plain synchronous calls for the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Optional

from kvfleet.worker.replica import ReplicaConfig, ReplicaServer


class ReplicaActor:
    """Wrap with ``ray.remote(num_cpus=…)(ReplicaActor)``; see :func:`kvfleet.deploy.launcher`."""

    def __init__(self, cfg: ReplicaConfig) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.cfg = cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-io",
                                        daemon=True)
        self._thread.start()
        self._server: Optional[ReplicaServer] = None

    def _run(self, coro, timeout_s: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> str:
        """Load the model and start serving; returns the gRPC address ``host:port``."""
        async def _start() -> str:
            self._server = ReplicaServer(self.cfg)
            return await self._server.start()
        return self._run(_start())

    def address(self) -> Optional[str]:
        return self._server.address if self._server else None

    def metrics_address(self) -> Optional[str]:
        """``host:port`` of the replica's Prometheus endpoint (``--metrics-port``), if any."""
        return self._server.metrics_address if self._server else None

    def stats(self) -> dict:
        return self._server.engine.stats() if self._server else {}

    def stop(self) -> bool:
        """Deregister from Redis and stop serving; safe to call twice."""
        if self._server is not None:
            self._run(self._server.stop())
            self._server = None
        return True
