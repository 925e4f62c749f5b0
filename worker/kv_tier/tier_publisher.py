"""A node tier's residency in the prefix index: which blocks the host tier holds.

The node's tier actor is the one writer of its entries (layout: :mod:`kvfleet.index_keys`,
"Host tier"): its store tells :meth:`TierPublisher.record` every block it stores or evicts,
in order, and a background thread writes the changes every ``interval_s`` seconds as one Lua
call that also appends a ``tblk`` entry to the KV event log (routers' mirrors follow it). The
thread also refreshes the entries' TTL every ``heartbeat_s`` seconds, so a node that is gone
for good leaves nothing behind.

Like the replicas' publisher it never raises into its caller: during a Redis outage changes are
dropped (logged once), and the first call after Redis answers registers the tier under a new
epoch and republishes everything the store holds. A stale or missing entry only costs a miss:
admission asks the tier itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

import redis
from redis.exceptions import RedisError

from kvfleet.allocator.hashing import HASH_BYTES
from kvfleet.index_keys import (
    DEFAULT_NAMESPACE,
    DEFAULT_TIMEOUT_S,
    REDIS_DOWN_ERRORS,
    IndexKeys,
    pack_chain,
    seconds_to_ms,
)
from kvfleet.worker.replica.kv_publisher import EPOCH_GUARD_LUA, emit_lua

log = logging.getLogger(__name__)

_LOST, _SUPERSEDED = -1, -2
# Hashes per script call (a republish, or a pass with many changes): Lua's unpack takes at
# most ~8,000 values, and a stored hash is two (hash, epoch).
BATCH = 1024

# KEYS: tier epochs, the tier's held hash, event log, event seq, event log origin.
_EMIT = emit_lua(3, 4, 5)

_REGISTER_LUA = _EMIT + """
-- ARGV: tier_id
local epoch = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('DEL', KEYS[2])
emit('treg', ARGV[1], epoch, '', '')
return epoch
"""


_PUBLISH_LUA = EPOCH_GUARD_LUA + _EMIT + """
-- ARGV: tier_id, epoch, removed, stored (hashes concatenated, %(w)d bytes each), TTL ms
local epoch, removed, stored = ARGV[2], ARGV[3], ARGV[4]
local gone, kept = {}, {}
for i = 1, #removed, %(w)d do gone[#gone + 1] = string.sub(removed, i, i + %(w)d - 1) end
for i = 1, #stored, %(w)d do
  kept[#kept + 1] = string.sub(stored, i, i + %(w)d - 1); kept[#kept + 1] = epoch
end
if #gone > 0 then redis.call('HDEL', KEYS[2], unpack(gone)) end
if #kept > 0 then
  redis.call('HSETNX', KEYS[2], '~', string.rep('~', 96))  -- see index_keys: held
  redis.call('HSET', KEYS[2], unpack(kept))
end
redis.call('PEXPIRE', KEYS[2], ARGV[5])
emit('tblk', ARGV[1], epoch, removed, stored)
return 1
""" % {"w": HASH_BYTES}

_HEARTBEAT_LUA = EPOCH_GUARD_LUA + """
-- ARGV: tier_id, epoch, TTL ms, 1 if the tier holds blocks (their entries must exist)
if redis.call('PEXPIRE', KEYS[2], ARGV[3]) == 0 and ARGV[4] == '1' then return -1 end
return 1
"""


class TierPublisher:
    """Publishes the residency of tier ``tier_id`` (``index_keys.tier_id(node)``).

    ``held_fn`` lists every chain hash the tier holds now (for a republish). Call
    :meth:`start` to run the writer thread, :meth:`close` to stop it; :meth:`flush` runs one
    pass on the caller's thread (tests). ``ttl_s``: the entries' TTL, refreshed every
    ``heartbeat_s`` seconds.

    Raises:
        ValueError: an interval, heartbeat or TTL not positive, or a TTL not above the
            heartbeat.
    """

    def __init__(self, url: str, tier_id: str, held_fn: Callable[[], list[bytes]],
                 namespace: str = DEFAULT_NAMESPACE, interval_s: float = 0.05,
                 heartbeat_s: float = 2.0, ttl_s: float = 30.0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry_interval_s: float = 1.0) -> None:
        if not (interval_s > 0 and heartbeat_s > 0 and ttl_s > heartbeat_s):
            raise ValueError("need interval_s > 0, heartbeat_s > 0 and ttl_s > heartbeat_s, got "
                             f"{interval_s}, {heartbeat_s}, {ttl_s}")
        self.tier_id, self._held_fn = tier_id, held_fn
        self._interval_s, self._heartbeat_s = interval_s, heartbeat_s
        self._ttl_ms, self._retry_interval_s = seconds_to_ms(ttl_s), retry_interval_s
        keys = IndexKeys(namespace)
        self._keys = [keys.tier_epochs, keys.tier_held(tier_id), keys.events, keys.events_seq,
                      keys.events_origin]
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self._register = self._redis.register_script(_REGISTER_LUA)
        self._publish = self._redis.register_script(_PUBLISH_LUA)
        self._heartbeat = self._redis.register_script(_HEARTBEAT_LUA)
        self.epoch = 0  # 0 until registered
        self._changes: dict[bytes, bool] = {}  # hash -> held, the latest change of each
        self._lock = threading.Lock()
        self._needs_sync = True
        self._discard = False  # down: changes are not kept (the resync republishes the store)
        self._superseded = False
        self._down_until = 0.0   # monotonic: no attempt before (an outage's back-off)
        self._outage = False
        self._next_beat = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-tier-index-{tier_id}")

    def record(self, changes: list[tuple[bytes, bool]]) -> None:
        """The store's listener: ``(hash, held now)`` in the order they happened. Quick."""
        with self._lock:
            if self._discard:
                return
            for h, held in changes:
                self._changes[h] = held

    @property
    def pending(self) -> int:
        """Changes waiting for the next pass (none kept while the index is down)."""
        with self._lock:
            return len(self._changes)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the writer thread (after one last pass) and close the client. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._redis.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()
        self.flush()

    def flush(self) -> None:
        """Write what changed since the last pass (registering first when needed). Never raises."""
        now = time.monotonic()
        if self._superseded or now < self._down_until:
            return
        try:
            if self._needs_sync:
                self._sync()
            status = self._write_changes()
            if status == 1 and now >= self._next_beat:
                holds = "1" if self._held_fn() else "0"
                status = int(self._heartbeat(keys=self._keys, args=[
                    self.tier_id, self.epoch, self._ttl_ms, holds]))
                self._next_beat = now + self._heartbeat_s
            if status == _LOST:  # Redis lost our entries: register again, republish
                self._sync()
            elif status == _SUPERSEDED:
                self._superseded = True
                log.warning("kv tier %s: a newer registration took over; index writes stop",
                            self.tier_id)
        except (*REDIS_DOWN_ERRORS, RedisError) as exc:
            self._needs_sync = True
            with self._lock:  # until the resync: its snapshot of the store has them all
                self._discard = True
                self._changes.clear()
            self._down_until = time.monotonic() + self._retry_interval_s
            if not self._outage:
                self._outage = True
                log.warning("kv tier %s: prefix index unreachable, residency not published: "
                            "%s: %s", self.tier_id, type(exc).__name__, exc)
            return
        if self._outage:
            self._outage = False
            log.warning("kv tier %s: prefix index reachable again", self.tier_id)

    def _write_changes(self) -> int:
        with self._lock:
            changes, self._changes = self._changes, {}
        if not changes:
            return 1
        # One latest change per hash: the removed and stored sets are disjoint, so batches of
        # each may go in any order.
        stored = [h for h, held in changes.items() if held]
        removed = [h for h, held in changes.items() if not held]
        status = 1
        for i in range(0, max(len(removed), len(stored)), BATCH):
            status = self._call(removed[i:i + BATCH], stored[i:i + BATCH])
            if status != 1:
                break
        return status

    def _call(self, removed: list[bytes], stored: list[bytes]) -> int:
        return int(self._publish(keys=self._keys, args=[
            self.tier_id, self.epoch, pack_chain(removed), pack_chain(stored), self._ttl_ms]))

    def _sync(self) -> None:
        """Register under a new epoch (entries start empty), then republish every held block.
        Changes recorded before the snapshot are in it; those after it follow as usual."""
        with self._lock:
            self._changes.clear()
            self._discard = False  # changes from here on follow the snapshot below
        self.epoch = int(self._register(keys=self._keys, args=[self.tier_id]))
        for batch in _batches(self._held_fn()):
            self._call([], batch)
        self._needs_sync = False
        self._next_beat = time.monotonic() + self._heartbeat_s
        log.info("kv tier %s registered in the prefix index: epoch %d", self.tier_id, self.epoch)


def _batches(items: Iterable[bytes]) -> Iterable[list[bytes]]:
    batch: list[bytes] = []
    for h in items:
        batch.append(h)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
