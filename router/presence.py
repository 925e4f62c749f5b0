"""A router's presence in Redis (``{ns}router:{id}``, see :mod:`kvfleet.index_keys`), so
``kvfleet status`` and ``Router.ClusterStatus`` can list every router of a cluster."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Optional

from kvfleet.index_keys import REDIS_DOWN_ERRORS, IndexKeys, redis_client, seconds_to_ms

log = logging.getLogger(__name__)

PRESENCE_TTL_S = 10.0
PRESENCE_INTERVAL_S = 2.0


class RouterPresence:
    """Writes this router's entry every ``interval_s`` seconds (TTL ``ttl_s``) until
    :meth:`close`, which deletes it. ``info``: JSON fields (address, http_address, policy)."""

    def __init__(self, redis_url: str, namespace: str, info: dict,
                 interval_s: float = PRESENCE_INTERVAL_S, ttl_s: float = PRESENCE_TTL_S) -> None:
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.info = {**info, "router_id": self.router_id, "pid": os.getpid(),
                     "started_at": time.time()}
        self._keys = IndexKeys(namespace)
        self.redis_url = redis_url
        self._redis = redis_client(redis_url)
        self._interval_s, self._ttl_ms = interval_s, seconds_to_ms(ttl_s)
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        while True:
            try:
                await self._redis.set(self._keys.router(self.router_id), json.dumps(self.info),
                                      px=self._ttl_ms)
            except REDIS_DOWN_ERRORS:
                pass  # the registry reader logs the outage
            await asyncio.sleep(self._interval_s)

    async def routers(self) -> list[dict]:
        """Every router of the namespace (this one included), by id. Raises the Redis
        client's errors when Redis does not answer."""
        keys = [k async for k in self._redis.scan_iter(match=self._keys.router_prefix + "*")]
        values = await self._redis.mget(keys) if keys else []
        return sorted((json.loads(v) for v in values if v), key=lambda r: r["router_id"])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self._redis.delete(self._keys.router(self.router_id))
        except REDIS_DOWN_ERRORS:
            pass
        await self._redis.aclose()
