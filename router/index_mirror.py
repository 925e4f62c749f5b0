"""The prefix index mirrored in the router's memory, fed by the workers' KV event log.

Why: a Redis lookup per request costs a round trip on every request's TTFT path (docs/routing.md,
"The index mirror"). Each router instead keeps every live replica's held block hashes in
memory and follows ``{ns}kv_events`` (written by the workers' index scripts in the same call as
the change, see :mod:`kvfleet.index_keys`); a lookup is then a few set probes. This is how
Dynamo's KV router works; SGLang's router keeps a tree of what it dispatched instead.

Consistency: the mirror snapshots each registered replica's ``{ns}held:{id}`` hash (with its
epoch), then replays the log from the sequence number read before the snapshot. Replaying an event
the snapshot already reflects is harmless: every event sets membership absolutely and events are
applied in log order, so each (replica, hash) ends at its last event. A gap in the sequence
(the reader fell more than ``EVENT_LOG_MAXLEN`` entries behind) or a new log origin (Redis
restarted or was flushed; every entry carries the origin, and an idle read checks it) means:
snapshot again. Until the mirror has read up to the log's tail,
and whenever a read fails, ``match`` asks Redis (:class:`RedisPrefixIndex`) instead — whose own
outage handling (``IndexUnavailable``, route by load) then applies unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

from redis.exceptions import RedisError

from kvfleet.allocator.hashing import HASH_BYTES
from kvfleet.index_keys import (
    DEFAULT_NAMESPACE,
    DEFAULT_TIMEOUT_S,
    REDIS_DOWN_ERRORS,
    IndexKeys,
    ReplicaInfo,
    ReplicaLoad,
    redis_client,
    unpack_chain,
)
from kvfleet.router.host_residency import (
    HostStarts,
    TierSets,
    apply_tier_event,
    count_host,
    expired_tiers,
    snapshot_tiers,
)
from kvfleet.router.prefix_index import PRUNE_AFTER_TTLS, RedisPrefixIndex

log = logging.getLogger(__name__)

_UNSET = object()  # no snapshot taken yet (or the last one is void)


class MirroredPrefixIndex:
    """:class:`~kvfleet.router.prefix_index.PrefixIndex` answering ``match`` from memory.

    ``fallback`` answers ``replicas()`` always and ``match`` while the mirror is not in sync.
    Liveness and epochs come from the latest ``replicas()`` read (the router's ReplicaSet
    refreshes it every 0.5 s): a replica counts when that read listed it and the mirror holds its
    entries under the same epoch — so a restarted replica's old entries stop counting as soon as
    either its register event or the next registry read arrives.

    ``block_s``: longest wait of one log read (seconds); the mirror counts as in sync while its
    last read reached the log's tail and returned less than ``block_s + 2 × timeout_s`` ago.
    ``batch``: log entries per read. ``min_interval_s``: once caught up, the shortest time
    between two reads that returned entries — one read per event would cost the router CPU for
    every event; batching bounds that at ``1 / min_interval_s`` reads per second whatever the
    fleet's event rate, for at most that much more lag, which stays below one engine step (a KV
    event leaves a worker only after the step that filled the blocks). Why its default:
    docs/routing.md, "The index mirror".
    Call :meth:`start` on the event loop that will use it.
    """

    def __init__(self, fallback: RedisPrefixIndex, url: str, namespace: str = DEFAULT_NAMESPACE,
                 block_s: float = 1.0, timeout_s: float = DEFAULT_TIMEOUT_S, batch: int = 512,
                 min_interval_s: float = 0.02, retry_s: float = 0.5) -> None:
        self.fallback = fallback
        self._keys = IndexKeys(namespace)
        self._block_ms = max(1, int(block_s * 1000))
        self._stale_after_s = block_s + 2 * timeout_s
        self._batch = batch
        self._min_interval_s = min_interval_s
        self._retry_s = retry_s
        # binary replies (hashes are raw bytes); reads wait up to block_s on the server
        # Any: redis-py types each reply as sync-or-async, and binary replies as str-or-bytes.
        self._redis: Any = redis_client(url, timeout_s, binary=True, read_timeout_s=block_s + timeout_s)
        self._held: dict[str, tuple[int, set[bytes]]] = {}  # replica → (epoch, block hashes)
        self._tiers: TierSets = {}  # node tier → (epoch, block hashes): host residency
        self._tier_seq: dict[str, int] = {}  # node tier → the last log entry about it
        self._live: dict[str, int] = {}        # replica → epoch, from the last registry read
        self._last_live: dict[str, float] = {}  # replica → monotonic s it was last listed live
        self._seq = 0                  # last log entry applied
        self._origin: object = _UNSET  # the log's origin when the snapshot was taken
        self._at_tail = False          # the last read reached the log's tail
        self._last_read = 0.0          # monotonic s of the last successful read
        self._task: Optional[asyncio.Task] = None
        self._closing = False
        self.snapshots = 0             # snapshots taken (a resnapshot = a gap or a new log)

    def start(self) -> None:
        """Start following the log in a background task of the running loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow())

    @property
    def local(self) -> bool:
        """``match`` answers from memory now (no Redis round trip)."""
        return self._at_tail and time.monotonic() - self._last_read <= self._stale_after_s

    async def match(self, chain: Sequence[bytes]) -> dict[str, int]:
        """As :meth:`PrefixIndex.match`; from memory when :attr:`local`, else from Redis."""
        if not self.local:
            return await self.fallback.match(chain)
        if not chain:
            return {}
        first, n, out = chain[0], len(chain), {}
        for rid, epoch in self._live.items():
            entry = self._held.get(rid)
            if entry is None or entry[0] != epoch or first not in entry[1]:
                continue
            held, k = entry[1], 1
            while k < n and chain[k] in held:
                k += 1
            out[rid] = k
        return out

    async def host_match(self, chain: Sequence[bytes], starts: HostStarts) -> dict[str, int]:
        """As :meth:`PrefixIndex.host_match`; from memory when :attr:`local`, else from Redis."""
        if not self.local:
            return await self.fallback.host_match(chain, starts)
        return count_host(chain, starts, self._tiers)

    def tier_ids(self) -> list[str]:
        """The node tiers the mirror follows (none while it is not in sync)."""
        return list(self._tiers) if self.local else []

    async def replicas(self) -> list[tuple[ReplicaInfo, ReplicaLoad | None]]:
        """The registry read (from Redis); also the liveness and epochs ``match`` uses, and the
        moment entries of replicas silent for ``PRUNE_AFTER_TTLS`` TTLs are dropped, and node
        tiers whose entries expired in Redis (:meth:`_drop_expired_tiers`)."""
        rows = await self.fallback.replicas()
        await self._drop_expired_tiers()
        now = time.monotonic()
        self._live = {info.replica_id: info.epoch for info, _ in rows}
        for rid in self._live:
            self._last_live[rid] = now
        horizon = now - PRUNE_AFTER_TTLS * self.fallback.replica_ttl_s
        for rid in [r for r in self._held if self._last_live.setdefault(r, now) < horizon]:
            del self._held[rid], self._last_live[rid]
        return rows

    async def _drop_expired_tiers(self) -> None:
        """Forget the tiers whose held entries expired in Redis (no event says so): a stopped
        tier is then credited no more, as by Redis itself, and its set is not kept for ever.
        A tier with an event or a snapshot since the check began is kept (the next read
        checks again), and so is every tier when Redis does not answer."""
        seq, tiers = self._seq, self._tiers
        try:
            gone = await expired_tiers(self._redis, self._keys, list(tiers))
        except (*REDIS_DOWN_ERRORS, RedisError) as exc:
            log.debug("prefix index mirror: tier expiry check failed: %s", exc)
            return
        if self._tiers is not tiers:
            return
        for tier in gone:
            if self._tier_seq.get(tier, 0) <= seq:
                tiers.pop(tier, None)
                self._tier_seq.pop(tier, None)

    async def sync(self, timeout_s: float = 5.0) -> None:
        """Wait until the mirror has applied every log entry written before this call (tests,
        and anyone who needs read-your-writes). Raises TimeoutError."""
        k = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            origin, seq = await pipe.get(k.events_origin).get(k.events_seq).execute()
        target = int(seq or 0)
        async with asyncio.timeout(timeout_s):
            while not (self.local and self._origin == origin and self._seq >= target):
                await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Stop following (within about ``block_s + timeout_s`` seconds) and close clients."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            # redis-py's cleanup of a cancelled read can turn the cancellation into a Redis
            # error; the _closing flag then ends the loop at its next turn
            await asyncio.wait({self._task}, timeout=2 * self._stale_after_s)
            self._task = None
        await self._redis.aclose()
        await self.fallback.close()

    # -- the follower -----------------------------------------------------------------------------

    async def _follow(self) -> None:
        while not self._closing:
            try:
                if self._origin is _UNSET:
                    await self._snapshot()
                if await self._read() and self._at_tail:
                    await asyncio.sleep(self._min_interval_s)  # let entries gather: fewer reads
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down, or a malformed entry: resnapshot, never stop
                if not isinstance(exc, (*REDIS_DOWN_ERRORS, RedisError)):
                    log.exception("prefix index mirror failed; resnapshotting")
                self._lose(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self._retry_s)

    def _lose(self, reason: str) -> None:
        """Stop answering from memory until a new snapshot has caught up with the log."""
        if self._at_tail:
            log.warning("prefix index mirror out of sync (%s); lookups go to Redis until it "
                        "has resnapshotted", reason)
        self._at_tail = False
        self._origin = _UNSET

    async def _snapshot(self) -> None:
        k = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            origin, seq, rids = await pipe.get(k.events_origin).get(k.events_seq) \
                .hkeys(k.registry).execute()
        held: dict[str, tuple[int, set[bytes]]] = {}
        for raw in rids:  # one replica per transaction: its epoch and held set agree
            rid = raw.decode()
            async with self._redis.pipeline(transaction=True) as pipe:
                epoch, entries = await pipe.hget(k.epochs, rid).hgetall(k.held(rid)).execute()
            if epoch is not None:
                held[rid] = (int(epoch), {h for h, e in entries.items()
                                          if e == epoch and len(h) == HASH_BYTES})
        tiers = await snapshot_tiers(self._redis, k)
        self._held, self._tiers, self._seq, self._origin = held, tiers, int(seq or 0), origin
        self._tier_seq = {}
        self.snapshots += 1
        log.info("prefix index mirror: snapshot of %d replicas, %d entries, log at %d",
                 len(held), sum(len(s) for _, s in held.values()), self._seq)

    async def _read(self) -> int:
        """Apply the next entries of the log; returns how many it applied."""
        k = self._keys
        # Wait for new entries only once caught up: a read that returns at once tells whether
        # the (re)snapshot has reached the tail.
        block = self._block_ms if self._at_tail else None
        got = await self._redis.xread({k.events: f"{self._seq}-0"}, count=self._batch,
                                      block=block)
        self._last_read = time.monotonic()
        entries = got[0][1] if got else []
        if not entries and await self._redis.get(k.events_origin) != self._origin:
            # A restarted log whose entries are all below our position shows up only here.
            self._lose("the event log restarted")
            return 0
        for entry_id, fields in entries:
            seq = int(entry_id.split(b"-", 1)[0])
            if fields[b"o"] != self._origin:
                self._lose("the event log restarted")
                return 0
            if seq != self._seq + 1:
                self._lose(f"event log gap: expected entry {self._seq + 1}, got {seq}")
                return 0
            self._seq = seq
            self._apply(fields)
        if len(entries) < self._batch and not self._at_tail:
            self._at_tail = True
            log.info("prefix index mirror in sync at log entry %d", self._seq)
        return len(entries)

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        """One log entry: ``reg`` (a new epoch starts empty), ``blk`` (removed, then stored),
        ``dereg`` (entries gone); ``treg`` / ``tblk`` the same for a node tier. Entries of an
        epoch older than the mirror's are ignored."""
        rid, epoch, kind = fields[b"r"].decode(), int(fields[b"e"]), fields[b"k"]
        if kind in (b"treg", b"tblk"):
            self._tier_seq[rid] = self._seq
            apply_tier_event(self._tiers, kind, rid, epoch, unpack_chain(fields[b"rm"]),
                             unpack_chain(fields[b"st"]))
            return
        entry = self._held.get(rid)
        if entry is not None and epoch < entry[0]:
            return
        if entry is None or epoch > entry[0] or kind == b"reg":
            entry = self._held[rid] = (epoch, set())
        held = entry[1]
        if kind == b"blk":
            held.difference_update(unpack_chain(fields[b"rm"]))
            held.update(unpack_chain(fields[b"st"]))
        elif kind == b"dereg":
            held.clear()
