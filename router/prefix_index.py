"""Read side of the prefix index: which live replica holds how many leading blocks of a chain.

Two implementations of :class:`PrefixIndex`: :class:`RedisPrefixIndex` (one Lua round trip per
lookup, layout in :mod:`kvfleet.index_keys`) and :class:`InMemoryPrefixIndex` (same semantics, for
scheduler/router unit tests; it hands out publishers with the API of
:class:`~kvfleet.worker.replica.kv_publisher.KvPublisher`). Redis is an index, not truth: a stale
answer only costs a cache miss.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Protocol, Sequence

from redis.exceptions import RedisError

from kvfleet.allocator.hashing import HASH_BYTES
from kvfleet.index_keys import (
    DEFAULT_NAMESPACE,
    DEFAULT_REPLICA_TTL_S,
    DEFAULT_TIMEOUT_S,
    LOAD_FIELDS,
    REDIS_DOWN_ERRORS,
    IndexKeys,
    ReplicaInfo,
    ReplicaLoad,
    pack_chain,
    redis_client,
    seconds_to_ms,
)
from kvfleet.router.host_residency import (
    HOST_MATCH_LUA,
    HostStarts,
    InMemoryTierPublisher,
    TierSets,
    count_host,
    host_match_args,
)

log = logging.getLogger(__name__)


class IndexUnavailable(Exception):
    """The index cannot be read now (Redis unreachable or too slow); route without it and retry later."""


class PrefixIndex(Protocol):
    async def match(self, chain: Sequence[bytes]) -> dict[str, int]:
        """Per live replica (current epoch), how many LEADING blocks of ``chain`` it holds.

        Counting stops at a replica's first miss (holding blocks 0, 1, 3 → 2). Replicas absent from
        the result hold 0. Raises :class:`IndexUnavailable` when the index cannot be read.
        """
        ...

    async def host_match(self, chain: Sequence[bytes], starts: HostStarts) -> dict[str, int]:
        """Per replica of ``starts`` (replica_id → (its node tier's id, the leading blocks of
        ``chain`` it holds on device)), how many of the chain's next blocks its node's host
        tier holds, up to the first miss: blocks the replica restores instead of computing.
        Replicas absent from the result: 0. Raises :class:`IndexUnavailable`."""
        ...

    def tier_ids(self) -> list[str]:
        """The node tiers known from memory (no round trip): a tier may hold blocks that no
        live replica names (a drained replica's, handed over). The Redis index knows none."""
        ...

    async def replicas(self) -> list[tuple[ReplicaInfo, ReplicaLoad | None]]:
        """Live replicas (heartbeat within the TTL) with their latest load, or ``None`` if expired."""
        ...

    async def close(self) -> None: ...

    @property
    def local(self) -> bool:
        """``match`` answers from this process's memory now (no round trip)."""
        ...


_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_MATCH_LUA = _NOW_MS + """
-- KEYS[1] heartbeats, KEYS[2] epochs; ARGV[1] replica TTL (ms), ARGV[2] block key prefix,
-- ARGV[3] the chain: block hashes concatenated, %(w)d bytes each, ARGV[4] held key prefix.
-- Returns {replica_id, count, ...}: 1 + (replicas holding block 0) commands, any chain length.
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf')
if #live == 0 then return {} end
local cur = redis.call('HMGET', KEYS[2], unpack(live))
local ids, eps = {}, {}  -- live replicas with their current epochs
for i, rid in ipairs(live) do
  if cur[i] then ids[#ids + 1] = rid; eps[#eps + 1] = cur[i] end
end
if #ids == 0 then return {} end
local pfx, chain = ARGV[2], ARGV[3]
local n = #chain / %(w)d
local blocks = {}
for b = 1, n do blocks[b] = string.sub(chain, %(w)d * (b - 1) + 1, %(w)d * b) end
local first = pfx .. blocks[1]
local got = redis.call('HMGET', first, unpack(ids))
local out = {}
for j = 1, #ids do
  if got[j] == eps[j] then
    local count = 0  -- leading blocks it holds, read %(step)d hashes per HMGET
    while count < n do
      local last = math.min(n, count + %(step)d)
      local held = redis.call('HMGET', ARGV[4] .. ids[j], unpack(blocks, count + 1, last))
      local k = 0
      while count + k < last and held[k + 1] == eps[j] do k = k + 1 end
      count = count + k
      if count < last then break end
    end
    out[#out + 1] = ids[j]; out[#out + 1] = count
    if count < n then  -- its first miss: drop an old epoch's entry there, if any
      local key = pfx .. blocks[count + 1]
      local e = redis.call('HGET', key, ids[j])
      if e and e ~= eps[j] then redis.call('HDEL', key, ids[j]) end
    end
  elseif got[j] then
    redis.call('HDEL', first, ids[j])  -- an old epoch's entry: clean it
  end
end
return out
""" % {"w": HASH_BYTES, "step": 1024}

_REPLICAS_LUA = _NOW_MS + """
-- KEYS: heartbeats, registry, epochs, sweep cursor; ARGV[1] TTL (ms), ARGV[2] load key prefix,
-- ARGV[3] prune after (ms), ARGV[4] block key SCAN pattern, ARGV[5] SCAN COUNT,
-- ARGV[6] held key prefix
local out = {}
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf')) do
  local info = redis.call('HGET', KEYS[2], rid)
  if info then
    out[#out + 1] = {rid, info, redis.call('HMGET', ARGV[2] .. rid, %(fields)s)}
  end
end
local horizon = now - tonumber(ARGV[3])
-- one page of the garbage sweep: members with a stale epoch or silent for the prune horizon
local page = redis.call('SCAN', redis.call('GET', KEYS[4]) or '0', 'MATCH', ARGV[4], 'COUNT', ARGV[5])
redis.call('SET', KEYS[4], page[1])
local valid = {}  -- replica_id -> epoch its entries must carry, or false
for _, key in ipairs(page[2]) do
  local m = redis.call('HGETALL', key)
  local stale = {}
  for j = 1, #m, 2 do
    local e = valid[m[j]]
    if e == nil then
      local hb = redis.call('ZSCORE', KEYS[1], m[j])
      e = (hb and tonumber(hb) >= horizon) and redis.call('HGET', KEYS[3], m[j]) or false
      valid[m[j]] = e
    end
    if e ~= m[j + 1] then stale[#stale + 1] = m[j] end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. horizon)
if #dead > 0 then
  redis.call('ZREM', KEYS[1], unpack(dead)); redis.call('HDEL', KEYS[2], unpack(dead))
  for _, rid in ipairs(dead) do redis.call('DEL', ARGV[6] .. rid) end
end
return out
""" % {"fields": ", ".join(f"'{f}'" for f in LOAD_FIELDS)}

PRUNE_AFTER_TTLS = 6  # registry entries and block members silent this many TTLs are garbage


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisPrefixIndex:
    """:class:`PrefixIndex` over Redis; safe to share between router tasks and router processes.

    ``replica_ttl_s``: a replica whose last heartbeat is older than this (seconds) does not count.
    Every call returns or raises :class:`IndexUnavailable` within about ``2 × timeout_s`` seconds,
    and works again as soon as Redis answers. Each ``replicas()`` call also sweeps ``sweep_count``
    block keys for garbage (old epochs, replicas silent ``PRUNE_AFTER_TTLS × replica_ttl_s``).
    """

    def __init__(self, url: str, namespace: str = DEFAULT_NAMESPACE,
                 replica_ttl_s: float = DEFAULT_REPLICA_TTL_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 sweep_count: int = 64):
        self._keys = IndexKeys(namespace)
        self.replica_ttl_s = replica_ttl_s
        self._ttl_ms = seconds_to_ms(replica_ttl_s)
        self._timeout_s = timeout_s
        self._sweep_count = sweep_count
        self._redis = redis_client(url, timeout_s)
        self._match = self._redis.register_script(_MATCH_LUA)
        self._host_match = self._redis.register_script(HOST_MATCH_LUA)
        self._replicas = self._redis.register_script(_REPLICAS_LUA)
        self._bad_entries: set = set()  # replica ids whose malformed entry was logged

    local = False  # every match is a Redis round trip

    async def _run(self, script, keys: list[str], args: list) -> list:
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                return await script(keys=keys, args=args)
        except (*REDIS_DOWN_ERRORS, RedisError) as e:  # unreachable, or refusing (OOM, BUSY, ...)
            raise IndexUnavailable(f"prefix index unreachable: {type(e).__name__}: {e}") from e

    async def match(self, chain: Sequence[bytes]) -> dict[str, int]:
        if not chain:
            return {}
        k = self._keys
        flat = await self._run(self._match, [k.heartbeats, k.epochs],
                               [self._ttl_ms, k.block_prefix, pack_chain(chain), k.held_prefix])
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def host_match(self, chain: Sequence[bytes], starts: HostStarts) -> dict[str, int]:
        if not chain or not starts:
            return {}
        keys, args = host_match_args(self._keys, pack_chain(chain), starts)
        flat = await self._run(self._host_match, keys, args)
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def tier_ids(self) -> list[str]:
        return []  # listing them would cost a round trip per route: the mirror knows them

    async def replicas(self) -> list[tuple[ReplicaInfo, ReplicaLoad | None]]:
        k = self._keys
        rows = await self._run(
            self._replicas, [k.heartbeats, k.registry, k.epochs, k.sweep_cursor],
            [self._ttl_ms, k.load_prefix, PRUNE_AFTER_TTLS * self._ttl_ms,
             _glob_escape(k.block_prefix) + "*", self._sweep_count, k.held_prefix])
        out = []
        for rid, info, load in rows:
            # One malformed entry (a foreign writer, a newer schema) must not hide the rest.
            try:
                out.append((ReplicaInfo.from_json(rid, info), ReplicaLoad.from_fields(load)))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                if rid not in self._bad_entries:  # one line per replica, not per read
                    self._bad_entries.add(rid)
                    log.warning("registry entry of replica %r is malformed, skipped: %s: %s",
                                rid, type(exc).__name__, exc)
        return out

    async def close(self) -> None:
        await self._redis.aclose()


class InMemoryPrefixIndex:
    """:class:`PrefixIndex` in one process, with the Redis index's semantics (epochs, TTL, lazy clean).

    ``clock`` gives seconds (default ``time.monotonic``; tests pass a fake one). Set ``available =
    False`` to simulate an outage: ``match``/``replicas`` then raise :class:`IndexUnavailable`.
    """

    def __init__(self, replica_ttl_s: float = DEFAULT_REPLICA_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.replica_ttl_s = replica_ttl_s
        self.clock = clock
        self.available = True
        self.blocks: dict[bytes, dict[str, int]] = {}
        self.epochs: dict[str, int] = {}
        self.registry: dict[str, ReplicaInfo] = {}
        self.beats: dict[str, float] = {}
        self.loads: dict[str, tuple[ReplicaLoad, float]] = {}  # load, expiry (clock seconds)
        self.tiers: TierSets = {}  # node tier id -> (epoch, held block hashes)

    local = True

    def tier_publisher(self, tier_id: str) -> InMemoryTierPublisher:
        """A writer of node tier ``tier_id``'s residency (a store listener)."""
        return InMemoryTierPublisher(self.tiers, tier_id)

    def tier_ids(self) -> list[str]:
        return list(self.tiers)

    async def host_match(self, chain: Sequence[bytes], starts: HostStarts) -> dict[str, int]:
        self._live_epochs()  # raises while marked unavailable
        return count_host(chain, starts, self.tiers)

    def publisher(self, replica: ReplicaInfo,
                  replica_ttl_s: float = DEFAULT_REPLICA_TTL_S) -> "InMemoryKvPublisher":
        """A writer for ``replica`` with ``KvPublisher``'s async API."""
        return InMemoryKvPublisher(self, replica, replica_ttl_s)

    def _live_epochs(self) -> dict[str, int]:
        if not self.available:
            raise IndexUnavailable("in-memory index marked unavailable")
        cutoff = self.clock() - self.replica_ttl_s
        return {rid: self.epochs[rid] for rid, at in self.beats.items() if at >= cutoff}

    async def match(self, chain: Sequence[bytes]) -> dict[str, int]:
        epoch = self._live_epochs()
        active, count = set(epoch), {}
        for i, h in enumerate(chain):
            if not active:
                break
            members = self.blocks.get(h, {})
            for rid in [r for r, e in members.items() if epoch.get(r) != e]:
                del members[rid]  # lazy clean, like the Lua script
            active &= set(members)
            for rid in active:
                count[rid] = i + 1
        return count

    async def replicas(self) -> list[tuple[ReplicaInfo, ReplicaLoad | None]]:
        live, now = self._live_epochs(), self.clock()
        horizon = now - PRUNE_AFTER_TTLS * self.replica_ttl_s
        for rid in [r for r, at in self.beats.items() if at < horizon]:
            del self.beats[rid], self.registry[rid]
        for members in self.blocks.values():  # the whole sweep at once (Redis: one page per call)
            for rid in [r for r, e in members.items() if r not in self.beats or self.epochs[r] != e]:
                del members[rid]
        out = []
        for rid in live:
            load, expires = self.loads.get(rid, (None, 0.0))
            out.append((self.registry[rid], load if expires > now else None))
        return out

    async def close(self) -> None:
        pass


class InMemoryKvPublisher:
    """``KvPublisher`` against an :class:`InMemoryPrefixIndex` (writes always land)."""

    def __init__(self, index: InMemoryPrefixIndex, replica: ReplicaInfo, replica_ttl_s: float):
        self._index, self._ttl_s = index, replica_ttl_s
        self.replica = replica
        self.epoch = 0  # 0 until registered
        self._held: set[bytes] = set()

    def _current(self) -> bool:
        return self.epoch > 0 and self._index.epochs.get(self.replica.replica_id) == self.epoch

    async def register(self) -> None:
        ix, rid = self._index, self.replica.replica_id
        self.epoch = ix.epochs[rid] = ix.epochs.get(rid, 0) + 1
        self.replica = dataclasses.replace(self.replica, epoch=self.epoch)
        ix.registry[rid], ix.beats[rid] = self.replica, ix.clock()
        ix.loads.pop(rid, None)
        await self.publish(list(self._held), ())  # like KvPublisher: republish what it holds

    async def publish(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        self._held.difference_update(removed)
        self._held.update(stored)
        if not self._current():
            return
        rid = self.replica.replica_id
        for h in removed:
            self._index.blocks.get(h, {}).pop(rid, None)
        for h in stored:
            self._index.blocks.setdefault(h, {})[rid] = self.epoch

    async def heartbeat(self, load: ReplicaLoad) -> None:
        if not self._current():
            return
        ix, rid = self._index, self.replica.replica_id
        ix.beats[rid], ix.registry[rid] = ix.clock(), self.replica
        ix.loads[rid] = (load, ix.clock() + self._ttl_s)

    async def deregister(self) -> None:
        if not self._current():
            return
        ix, rid = self._index, self.replica.replica_id
        for table in (ix.registry, ix.beats, ix.loads):
            table.pop(rid, None)
        for members in ix.blocks.values():
            if members.get(rid) == self.epoch:
                del members[rid]

    async def close(self) -> None:
        pass
