"""Runtime adapter changes of one model, recorded in Redis (``{ns}adapters:{model}``, see
:mod:`kvfleet.index_keys`) so that a replica started later — a scale-up, a crash replacement,
an upgrade — serves the adapters loaded at run time and not those unloaded, instead of only
its start-time set."""

from __future__ import annotations

import json
import logging

from kvfleet.index_keys import DEFAULT_NAMESPACE, IndexKeys, redis_client

log = logging.getLogger(__name__)

UNLOADED = None  # the value :meth:`AdapterRecord.read` gives a name unloaded at run time


class AdapterRecord:
    """The record of ``model``'s runtime adapter changes in the Redis at ``url``.

    Every method raises what redis-py raises when Redis does not answer (callers decide)."""

    def __init__(self, url: str, model: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        self._key = IndexKeys(namespace).adapters(model)
        self._redis = redis_client(url)

    async def loaded(self, name: str, path: str) -> None:
        """``name`` is served from directory ``path`` from now on."""
        await self._redis.hset(self._key, name, json.dumps({"path": path}))

    async def unloaded(self, name: str) -> None:
        """``name`` is no longer served (a start-time adapter included)."""
        await self._redis.hset(self._key, name, json.dumps({"unloaded": True}))

    async def read(self) -> dict[str, str | None]:
        """name → directory, or :data:`UNLOADED`; entries that do not parse are skipped
        (and logged)."""
        out: dict[str, str | None] = {}
        for name, raw in (await self._redis.hgetall(self._key)).items():
            try:
                entry = json.loads(raw)
                out[str(name)] = UNLOADED if entry.get("unloaded") else str(entry["path"])
            except (ValueError, KeyError, TypeError, AttributeError):
                log.error("adapter record %s: entry %r is malformed; ignored", self._key, name)
        return out

    async def close(self) -> None:
        await self._redis.aclose()
