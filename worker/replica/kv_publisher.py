"""Write side of the prefix index: a replica's registry entry, heartbeat/load and block events.

Layout and epoch rules: :mod:`kvfleet.index_keys`. Every write is one Lua script call (one round
trip) that first checks the replica's epoch in ``{ns}epochs``:

- equal → apply; a publish applies ``removed`` first, then ``stored`` (a hash in both ends stored);
- missing → Redis lost its data (restart, flush): re-register under a new epoch and republish every
  hash this replica still holds (the publisher mirrors them from its own events);
- higher → a newer process with the same ``replica_id`` registered: this one is superseded and stops
  writing for good (logged once), so a lingering old process cannot touch the new one's entries.

Register, publish and deregister also append their change to the KV event log in the same call
(``{ns}kv_events``), which routers follow to mirror the index in memory.

Redis outages never raise into the engine: errors are logged once per outage, writes are dropped
(at most one attempt per ``retry_interval_s`` seconds, each bounded by ``timeout_s``), and the first
call after Redis answers again re-registers (new epoch) and republishes the held set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Iterable, Sequence

from redis.exceptions import RedisError

from kvfleet.allocator.hashing import HASH_BYTES
from kvfleet.index_keys import (
    DEFAULT_NAMESPACE,
    DEFAULT_REPLICA_TTL_S,
    DEFAULT_TIMEOUT_S,
    EVENT_LOG_MAXLEN,
    LOAD_FIELDS,
    REDIS_DOWN_ERRORS,
    IndexKeys,
    ReplicaInfo,
    ReplicaLoad,
    pack_chain,
    redis_client,
    seconds_to_ms,
)

log = logging.getLogger(__name__)

REPUBLISH_BATCH = 1024  # block hashes per script call when republishing (bounds one call to ~ms)
_LOST, _SUPERSEDED = -1, -2

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


def emit_lua(log: int, seq: int, origin: int) -> str:
    """Lua ``emit(kind, id, epoch, removed, stored)``: append one event-log entry
    (index_keys: "Event log"), with the log, its seq and its origin at these KEYS positions."""
    return """
local function emit(kind, rid, epoch, removed, stored)
  local seq, origin = redis.call('INCR', KEYS[%(seq)d]), redis.call('GET', KEYS[%(origin)d])
  if seq == 1 or not origin then  -- a new log (first write, or Redis lost it): readers resnapshot
    redis.call('DEL', KEYS[%(log)d])
    redis.call('SET', KEYS[%(seq)d], 1)
    seq = 1
    local t = redis.call('TIME')
    origin = t[1] .. '.' .. t[2]
    redis.call('SET', KEYS[%(origin)d], origin)
  end
  redis.call('XADD', KEYS[%(log)d], 'MAXLEN', '~', %(maxlen)d, seq .. '-0', 'o', origin, 'k', kind,
             'r', rid, 'e', epoch, 'rm', removed, 'st', stored)
end
""" % {"maxlen": EVENT_LOG_MAXLEN, "log": log, "seq": seq, "origin": origin}


# Every script gets the keys of ``KvPublisher._replica_keys``: epochs, heartbeats, registry, load
# key, held key, event log, event seq, event log origin. ``emit`` appends one event-log entry
# (index_keys: "Event log") in the same call as the change it describes.
_EMIT = emit_lua(6, 7, 8)

_REGISTER_LUA = _NOW_MS + _EMIT + """
-- ARGV: replica_id, registry JSON (epoch filled here)
local epoch = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
local info = cjson.decode(ARGV[2]); info['epoch'] = epoch
redis.call('HSET', KEYS[3], ARGV[1], cjson.encode(info))
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('DEL', KEYS[4], KEYS[5])  -- the old epoch's per-replica entries: republished next
emit('reg', ARGV[1], epoch, '', '')
return epoch
"""

# Lua: go on only while the epoch hash KEYS[1] holds ARGV[2] for ARGV[1] (-1: not
# registered, -2: a newer epoch took over). Shared with the node tier's publisher.
EPOCH_GUARD_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return -1 end
if cur ~= ARGV[2] then return -2 end
"""

_PUBLISH_LUA = EPOCH_GUARD_LUA + _EMIT + """
-- ARGV: replica_id, epoch, block key prefix, removed hashes, stored hashes (each concatenated,
-- %(w)d bytes per hash), block TTL ms (0 = none)
local rid, epoch, pfx, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[6])
local removed, stored = ARGV[4], ARGV[5]
local gone, kept = {}, {}
for i = 1, #removed, %(w)d do
  local h = string.sub(removed, i, i + %(w)d - 1)
  redis.call('HDEL', pfx .. h, rid); gone[#gone + 1] = h
end
for i = 1, #stored, %(w)d do
  local h = string.sub(stored, i, i + %(w)d - 1)
  local key = pfx .. h
  redis.call('HSET', key, rid, epoch)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
  kept[#kept + 1] = h; kept[#kept + 1] = epoch
end
if #gone > 0 then redis.call('HDEL', KEYS[5], unpack(gone)) end
if #kept > 0 then
  -- a value longer than hash-max-listpack-value (64 B by default) keeps the hash in hashtable
  -- encoding: the lookup's HMGET of a whole chain is then O(chain), not O(chain × entries)
  redis.call('HSETNX', KEYS[5], '~', string.rep('~', 96))
  redis.call('HSET', KEYS[5], unpack(kept))
  if ttl > 0 then redis.call('PEXPIRE', KEYS[5], ttl) end
end
emit('blk', rid, epoch, removed, stored)
return 1
""" % {"w": HASH_BYTES}

_HEARTBEAT_LUA = _NOW_MS + EPOCH_GUARD_LUA + """
-- ARGV: replica_id, epoch, registry JSON, load TTL ms, load values...
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], %s)
redis.call('PEXPIRE', KEYS[4], ARGV[4])
return 1
""" % ", ".join(f"'{f}', ARGV[{5 + i}]" for i, f in enumerate(LOAD_FIELDS))

_DEREGISTER_LUA = EPOCH_GUARD_LUA + _EMIT + """
-- ARGV: replica_id, epoch
redis.call('ZREM', KEYS[2], ARGV[1]); redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4], KEYS[5])
emit('dereg', ARGV[1], ARGV[2], '', '')
return 1
"""


class KvPublisher:
    """Publishes one replica's registry entry, heartbeats, load and KV block events to Redis.

    ``replica.epoch`` is ignored: ``register()`` assigns it (``HINCRBY {ns}epochs``); ``epoch`` and
    ``replica`` hold the current one (0 until the first successful registration).
    ``replica_ttl_s``: TTL of the load record (seconds); heartbeat well within the routers' TTL.
    ``block_ttl_s``: optional TTL (seconds) on block keys, refreshed on each store; ``None`` = none.
    """

    def __init__(self, url: str, replica: ReplicaInfo, namespace: str = DEFAULT_NAMESPACE,
                 replica_ttl_s: float = DEFAULT_REPLICA_TTL_S, block_ttl_s: float | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry_interval_s: float = 1.0):
        self.replica = replica
        self.epoch = 0  # 0 until registered; epochs assigned by Redis start at 1
        self._keys = IndexKeys(namespace)
        self._load_ttl_ms = seconds_to_ms(replica_ttl_s)
        self._block_ttl_ms = seconds_to_ms(block_ttl_s) if block_ttl_s else 0
        self._retry_interval_s = retry_interval_s
        self._started_at = time.time()
        self._held: set[bytes] = set()
        self._wanted = False          # register() was called and deregister() was not
        self._needs_sync = True       # (re-)register and republish before the next write
        self._superseded = False
        self._outage_since: float | None = None  # monotonic seconds; None = Redis answering
        self._next_try = 0.0
        self._lock = asyncio.Lock()
        self._redis = redis_client(url, timeout_s)
        self._register = self._redis.register_script(_REGISTER_LUA)
        self._publish = self._redis.register_script(_PUBLISH_LUA)
        self._heartbeat = self._redis.register_script(_HEARTBEAT_LUA)
        self._deregister = self._redis.register_script(_DEREGISTER_LUA)

    @property
    def connected(self) -> bool:
        """Registered under a current epoch and Redis answered the last call."""
        return self.epoch > 0 and not self._needs_sync and self._outage_since is None

    @property
    def held(self) -> frozenset[bytes]:
        """The block hashes this replica holds, as told by its own events."""
        return frozenset(self._held)

    async def register(self) -> None:
        """Write the registry entry under a new epoch (and republish held blocks). Never raises."""
        self._wanted, self._needs_sync = True, True
        await self._guarded(self._noop)

    async def publish(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """One engine step's events: ``removed`` applied first, then ``stored``. Never raises."""
        self._held.difference_update(removed)
        self._held.update(stored)
        if stored or removed:
            await self._guarded(lambda: self._write_blocks(stored, removed))

    def describe(self, **fields) -> None:
        """Change fields of the registry entry (``state``, ``prefix_hit_rate``, …; not the
        epoch): the next heartbeat writes them. Raises TypeError for an unknown field."""
        fields.pop("epoch", None)
        self.replica = dataclasses.replace(self.replica, **fields)

    async def heartbeat(self, load: ReplicaLoad) -> None:
        """Refresh liveness (Redis server clock) and the load record (TTL). Never raises."""
        def beat():  # built at call time: a re-registration just before changes the epoch
            args = [self.replica.to_json(self._started_at), self._load_ttl_ms, *load.to_fields()]
            return self._call(self._heartbeat, self._replica_keys(), args)
        await self._guarded(beat)

    async def deregister(self) -> None:
        """Leave the registry (entries stop counting at once) and delete this epoch's block entries."""
        self._wanted = False
        if self.epoch == 0 or self._superseded:
            return
        async def remove() -> int:
            status = await self._call(self._deregister, self._replica_keys(), [])
            for batch in _batches(self._held):
                await self._write_blocks((), batch)
            return status
        await self._guarded(remove, sync_first=False)

    async def close(self) -> None:
        await self._redis.aclose()

    # -- internals -------------------------------------------------------------------------------

    async def _noop(self) -> int:
        return 1

    def _replica_keys(self) -> list[str]:
        k, rid = self._keys, self.replica.replica_id
        return [k.epochs, k.heartbeats, k.registry, k.load(rid), k.held(rid), k.events,
                k.events_seq, k.events_origin]

    async def _call(self, script, keys: list[str], args: list) -> int:
        return int(await script(keys=keys, args=[self.replica.replica_id, self.epoch, *args]))

    async def _write_blocks(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> int:
        args = [self._keys.block_prefix, pack_chain(removed), pack_chain(stored), self._block_ttl_ms]
        return await self._call(self._publish, self._replica_keys(), args)

    async def _sync(self) -> None:
        """Register under a new epoch, then republish the whole held set under it."""
        r = self.replica
        info = dataclasses.replace(r, epoch=0)
        epoch = int(await self._register(keys=self._replica_keys(),
                                         args=[r.replica_id, info.to_json(self._started_at)]))
        self.epoch = epoch
        self.replica = dataclasses.replace(r, epoch=epoch)
        for batch in _batches(self._held):
            await self._write_blocks(batch, ())
        self._needs_sync = False
        log.info("replica %s registered in the prefix index: epoch %d, %d blocks",
                 r.replica_id, epoch, len(self._held))

    async def _guarded(self, op, sync_first: bool = True) -> None:
        """Run ``op`` (re-registering first when needed); swallow and log Redis outages.

        During an outage only one attempt per ``retry_interval_s`` is made (deregister always tries).
        """
        if self._superseded or (sync_first and not self._wanted):
            return
        if sync_first and self._outage_since is not None and time.monotonic() < self._next_try:
            return
        try:
            async with self._lock:  # each Redis call is bounded by the socket timeouts
                if sync_first and self._needs_sync:
                    await self._sync()
                status = await op()
                if status == _LOST and sync_first:  # Redis lost our registration: start over
                    await self._sync()
                    status = await op()
        except (*REDIS_DOWN_ERRORS, RedisError) as e:  # OOM, BUSY, ... are outages too here
            self._needs_sync = True
            self._next_try = time.monotonic() + self._retry_interval_s
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                log.warning("prefix index unreachable, replica %s keeps serving without it: %s: %s",
                            self.replica.replica_id, type(e).__name__, e)
            return
        if self._outage_since is not None:
            log.warning("prefix index reachable again after %.1f s (replica %s)",
                        time.monotonic() - self._outage_since, self.replica.replica_id)
            self._outage_since = None
        if status == _SUPERSEDED:
            self._superseded = True
            log.warning("replica %s epoch %s superseded by a newer registration; index writes stop",
                        self.replica.replica_id, self.epoch)


def _batches(hashes: Iterable[bytes]) -> Iterable[list[bytes]]:
    items = list(hashes)
    for i in range(0, len(items), REPUBLISH_BATCH):
        yield items[i:i + REPUBLISH_BATCH]
