"""A synchronous read of one kvfleet namespace's registry in Redis, for the launcher and
``kvfleet status`` (routers read it asynchronously, ``router/prefix_index.py``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

import redis

from kvfleet.index_keys import LOAD_FIELDS, IndexKeys, ReplicaInfo, ReplicaLoad


@dataclass(frozen=True)
class RegistryEntry:
    """One registered replica: its entry, last load report (None: expired), seconds since
    its last heartbeat (Redis server clock; None: no heartbeat recorded)."""

    info: ReplicaInfo
    load: Optional[ReplicaLoad]
    heartbeat_age_s: Optional[float]


def read_registry(redis_url: str, namespace: str, timeout_s: float = 2.0) -> list[RegistryEntry]:
    """Every replica registered under ``namespace``, sorted by id.

    Raises redis.exceptions.ConnectionError / TimeoutError when Redis does not answer."""
    keys = IndexKeys(namespace)
    r = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        raw = r.hgetall(keys.registry)
        ids = sorted(k.decode() if isinstance(k, bytes) else k for k in raw)
        pipe = r.pipeline()
        pipe.time()
        for rid in ids:
            pipe.zscore(keys.heartbeats, rid)
            pipe.hmget(keys.load(rid), LOAD_FIELDS)
        replies = pipe.execute()
    finally:
        r.close()
    seconds, micros = replies[0]
    now_ms = seconds * 1000 + micros / 1000
    out = []
    for n, rid in enumerate(ids):
        beat, load = replies[1 + 2 * n], replies[2 + 2 * n]
        out.append(RegistryEntry(
            ReplicaInfo.from_json(rid, raw[rid.encode()]),
            ReplicaLoad.from_fields([None if v is None else v.decode() for v in load]),
            None if beat is None else max(0.0, (now_ms - beat) / 1000)))
    return out


def registry_entries(redis_url: str, namespace: str) -> list[ReplicaInfo]:
    """The registry entries alone (see :func:`read_registry`)."""
    return [e.info for e in read_registry(redis_url, namespace)]


def wait_gone(redis_url: str, namespace: str, replica_ids, timeout_s: float = 30.0) -> bool:
    """True once none of ``replica_ids`` is registered (False after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    wanted = set(replica_ids)
    while time.monotonic() < deadline:
        if not wanted & {i.replica_id for i in registry_entries(redis_url, namespace)}:
            return True
        time.sleep(0.1)
    return False


def read_routers(redis_url: str, namespace: str, timeout_s: float = 2.0) -> list[dict]:
    """The routers present under ``namespace`` (``router/presence.py``), by id."""
    prefix = IndexKeys(namespace).router_prefix
    r = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        keys = list(r.scan_iter(match=prefix + "*"))
        values = r.mget(keys) if keys else []
    finally:
        r.close()
    return sorted((json.loads(v) for v in values if v), key=lambda x: x["router_id"])
