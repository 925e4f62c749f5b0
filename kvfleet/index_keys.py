"""The Redis layout of the prefix index and replica registry, defined once (docs/design.md §2).

Every key starts with a configurable namespace (default ``kvfleet:``)::

    {ns}block:{hash}      HASH   replica_id -> epoch        replicas holding one KV block (raw 16 bytes)
    {ns}held:{replica_id} HASH   block hash -> epoch        the same entries, per replica (plus a
                                 field "~" with a 96-byte value: keeps the hash out of listpack
                                 encoding, whose HMGET is O(fields × entries))
    {ns}epochs            HASH   replica_id -> epoch        current epoch per replica id (never deleted)
    {ns}registry          HASH   replica_id -> JSON         address, model, epoch, block_size, started_at,
                                 adapters (name, revision), resident_adapters, identity
    {ns}heartbeats        ZSET   replica_id @ last beat     score = Redis server time, milliseconds
    {ns}load:{replica_id} HASH   running, waiting, num_free_blocks, num_total_blocks, updated_at,
                                 queue_delay_s, prefill_token_s (PEXPIRE = the publisher's
                                 replica TTL; the last two absent in older replicas' records)
    {ns}router:{id}       STRING JSON of one router: address, http_address, policy, pid, started_at
                                 (PEXPIRE: rewritten every few seconds, gone ~10 s after it stops)
    {ns}adapters:{model}  HASH   adapter name -> JSON       runtime LoadAdapter / UnloadAdapter of one model:
                                 {"path": DIR} or {"unloaded": true}; a replica applies it
                                 over its start-time adapters when it starts (kept while the
                                 cluster's namespace lives: it is configuration, not index)
    {ns}tenant_inflight:{tenant}
                          ZSET   "{router_id}/{request_id}" @ lease end: one tenant's in-flight
                                 requests over every router (score = Redis time + lease, ms;
                                 renewed by the holding router, ZREM on finish, expired members
                                 dropped at each admission; PEXPIRE = the lease: a key no router
                                 renews is gone a lease later) — kvfleet.router.tenant_limits
    {ns}tenant_service    HASH   tenant -> service: weighted tokens the fleet computed for it
                                 (uncached prompt × 1 + output × 2), added by each router every
                                 few seconds; PEXPIRE a day after the last addition
    {ns}sweep_cursor      STRING SCAN cursor of the incremental garbage sweep, shared by all routers
    {ns}tier_epochs       HASH   tier_id -> epoch           current epoch of each node's host KV tier
                                 (tier_id = "tier:{ray node id}"; HINCRBY when a tier's
                                 publisher (re)registers: a restarted tier starts empty)
    {ns}tier_held:{tier_id}
                          HASH   block hash -> epoch        blocks a node's host tier holds (rank 0's
                                 shard written; the same "~" padding field as held:); PEXPIRE
                                 refreshed by the tier's heartbeat: gone soon after its node
    {ns}kv_events         STREAM the KV event log: one entry per index write of a replica or a
                                 tier, id ``{seq}-0``; fields o (the log's origin), k (reg |
                                 blk | dereg for a replica; treg | tblk for a tier), r
                                 (replica_id or tier_id), e (epoch), rm / st (removed / stored
                                 hashes, concatenated); MAXLEN ~ 10,000
    {ns}kv_events_seq     STRING seq of the last entry (INCR); 1 starts a new log (stream reset)
    {ns}kv_events_origin  STRING Redis TIME when the current log started: a reader that sees it
                                 change knows the log restarted (Redis restarted or was flushed)

**Epochs.** ``register()`` does ``HINCRBY {ns}epochs replica_id 1``: a restarted replica with the same
id gets a strictly higher epoch, and block entries tagged with an older epoch stop counting at once.
The counter survives deregistration, so epochs never repeat while Redis keeps its data; a restarted
(empty) Redis restarts the counters, which is harmless because it also lost every block entry.

**Liveness.** A replica counts when its heartbeat (server clock, so host clocks never matter) is
within the reader's ``replica_ttl_s`` and the block entry's epoch equals ``{ns}epochs``. Garbage is
cleaned lazily: the lookup deletes old-epoch members of live replicas it meets, and each registry read
(``replicas()``, every refresh) sweeps one SCAN page of block keys, deleting members with a stale
epoch or whose replica has been silent for 6 TTLs. ``block_ttl_s`` can add a TTL as a safety net.

**Lookup cost.** Every entry is written twice (per block and per replica, in the same script
call): the lookup reads the first block's key to find the replicas holding the chain's start,
then one ``HMGET`` of the whole chain per such replica — ``1 + holders`` commands inside one
script call, whatever the prompt length. ``register()`` deletes the replica's ``held`` hash
(the new epoch republishes it), ``deregister()`` and the sweep of silent replicas too.

**Host tier.** A replica with a host tier names it in its registry entry (``kv_tier``); the
tier (one Ray actor per node, :mod:`kvfleet.worker.kv_tier.tier_publisher`) is the only writer
of its own entries, so its write-backs and LRU evictions reach the index in the order they
happened. A block in a replica's node tier is reachable by that replica after its device
prefix (admission restores it): routers count it as a host hit
(:meth:`kvfleet.router.prefix_index.PrefixIndex.host_match`). Readers that predate tiers skip
``treg``/``tblk`` entries (an unknown ``r`` that no registry entry names).

**Event log.** The same script call that changes a replica's entries appends one entry to
``{ns}kv_events``, so the log and the hashes never disagree. Routers keep an in-memory mirror of
the held sets (:mod:`kvfleet.router.index_mirror`): snapshot the ``held`` hashes, then follow the
log; a gap in ``seq`` (trimmed) or a new origin means: snapshot again.

Block keys hold the raw hash bytes (no hex): scripts receive a chain as ONE argument (hashes
concatenated) and build the keys themselves, which keeps a 64-block lookup's packing cheap. The
layout is written for one Redis (not Redis Cluster): scripts build keys that are not in KEYS.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Optional, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvfleet.allocator.hashing import HASH_BYTES

DEFAULT_NAMESPACE = "kvfleet:"
DEFAULT_REPLICA_TTL_S = 10.0
DEFAULT_TIMEOUT_S = 0.5
EVENT_LOG_MAXLEN = 10_000  # entries kept in {ns}kv_events (~); a reader further behind resnapshots
# Appended fields only (a rolling upgrade reads records written by older replicas, which lack
# the tail: ReplicaLoad.from_fields takes them as absent).
LOAD_FIELDS = ("running", "waiting", "num_free_blocks", "num_total_blocks", "updated_at",
               "queue_delay_s", "prefill_token_s", "spec_drafted_tokens", "spec_accepted_tokens")
REQUIRED_LOAD_FIELDS = 5  # the leading fields every record carries


@dataclass(frozen=True)
class ReplicaInfo:
    """A worker replica as the registry knows it; ``epoch`` is assigned by ``register()``.

    ``max_requests``: sequences the replica holds at most (running + waiting), past which it
    refuses, so routers refuse before dispatching; 0 = not advertised. ``max_queue_wait_s``:
    the longest predicted wait before a request's prefill starts that the replica admits
    (``worker/service/wait_bound.py``); 0 = not advertised.
    """

    replica_id: str
    address: str
    model: str
    epoch: int
    block_size: int
    max_requests: int = 0
    max_queue_wait_s: float = 0.0
    tensor_parallel_size: int = 1
    # One dict per rank, rank 0 first: the fields of kvfleet.v1.RankStatus.
    ranks: tuple[dict, ...] = ()
    # Lifecycle (rewritten by every heartbeat): "serving", or "draining" (routers stop
    # sending it requests); its Serve replica, Prometheus endpoint, prefix-hit rate over the
    # last minute (cached / prompt tokens of finished requests, 0..1).
    state: str = "serving"
    serve_replica: str = ""
    metrics_address: str = ""
    prefix_hit_rate: float = 0.0
    # LoRA: the adapters it may serve, (name, revision) sorted, and those in its slots now
    # (refreshed with every heartbeat).
    adapters: tuple[tuple[str, str], ...] = ()
    resident_adapters: tuple[str, ...] = ()
    # The hex digest of the model's cache identity (DESIGN §2: weights, tokenizer, chat template,
    # KV dtype, block size) the replica hashes with; routers dispatch only where it is theirs.
    identity: str = ""
    # Its node's host KV tier ("tier:{node id}"; index_keys "Host tier"), "" without one.
    kv_tier: str = ""

    def adapter_revision(self, name: str) -> str | None:
        """The revision it serves adapter ``name`` at, or None."""
        return next((rev for n, rev in self.adapters if n == name), None)

    def to_json(self, started_at: float) -> str:
        """Registry value; ``started_at`` is unix seconds."""
        return json.dumps(
            {"address": self.address, "model": self.model, "epoch": self.epoch,
             "block_size": self.block_size, "max_requests": self.max_requests,
             "max_queue_wait_s": self.max_queue_wait_s, "started_at": started_at,
             "tensor_parallel_size": self.tensor_parallel_size, "ranks": list(self.ranks),
             "adapters": [list(a) for a in self.adapters],
             "resident_adapters": list(self.resident_adapters),
             "state": self.state, "serve_replica": self.serve_replica,
             "metrics_address": self.metrics_address, "prefix_hit_rate": self.prefix_hit_rate,
             "identity": self.identity, "kv_tier": self.kv_tier},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, replica_id: str, raw: str | bytes) -> "ReplicaInfo":
        d = json.loads(raw)
        return cls(replica_id=replica_id, address=str(d["address"]), model=str(d["model"]),
                   epoch=int(d["epoch"]), block_size=int(d["block_size"]),
                   max_requests=int(d.get("max_requests", 0)),
                   max_queue_wait_s=float(d.get("max_queue_wait_s", 0.0)),
                   tensor_parallel_size=int(d.get("tensor_parallel_size", 1)),
                   ranks=tuple(dict(r) for r in d.get("ranks", ())),
                   adapters=tuple((str(n), str(r)) for n, r in d.get("adapters", ())),
                   resident_adapters=tuple(str(n) for n in d.get("resident_adapters", ())),
                   state=str(d.get("state", "serving")),
                   serve_replica=str(d.get("serve_replica", "")),
                   metrics_address=str(d.get("metrics_address", "")),
                   prefix_hit_rate=float(d.get("prefix_hit_rate", 0.0)),
                   identity=str(d.get("identity", "")),
                   kv_tier=str(d.get("kv_tier", "")))


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's latest load report; ``updated_at`` is unix seconds (the worker's clock).

    ``queue_delay_s``: predicted seconds until a request arriving at report time could start its
    prefill; ``prefill_token_s``: the replica's marginal seconds per uncached prompt token
    (``worker/step_cost/queue_delay.py``). Both ``None`` when not advertised (an older replica).
    ``spec_drafted_tokens`` / ``spec_accepted_tokens``: speculative decoding's drafts verified
    and accepted since the replica started (``None``: not advertised).
    """

    running: int
    waiting: int
    num_free_blocks: int
    num_total_blocks: int
    updated_at: float
    queue_delay_s: Optional[float] = None
    prefill_token_s: Optional[float] = None
    spec_drafted_tokens: Optional[int] = None
    spec_accepted_tokens: Optional[int] = None

    @property
    def spec_acceptance(self) -> Optional[float]:
        """Accepted ÷ drafted speculative tokens (None: none drafted, or not advertised)."""
        if not self.spec_drafted_tokens or self.spec_accepted_tokens is None:
            return None
        return self.spec_accepted_tokens / self.spec_drafted_tokens

    @property
    def has_forecast(self) -> bool:
        """Both forecast fields are advertised."""
        return self.queue_delay_s is not None and self.prefill_token_s is not None

    def to_fields(self) -> list[str]:
        """Values in ``LOAD_FIELDS`` order, as strings for Redis ("" = not advertised)."""
        return [str(self.running), str(self.waiting), str(self.num_free_blocks),
                str(self.num_total_blocks), repr(float(self.updated_at)),
                _optional_float(self.queue_delay_s), _optional_float(self.prefill_token_s),
                _optional_int(self.spec_drafted_tokens), _optional_int(self.spec_accepted_tokens)]

    @classmethod
    def from_fields(cls, values: list) -> "ReplicaLoad | None":
        """Inverse of ``to_fields``; ``None`` when the record is missing or expired. The
        forecast fields may be missing (``None``/``False``/"", or a shorter list: an older
        replica's record). Raises ValueError for a non-numeric or negative forecast."""
        head = list(values[:REQUIRED_LOAD_FIELDS]) if values else []
        if len(head) < REQUIRED_LOAD_FIELDS or any(v is None or v is False for v in head):
            return None
        r, w, free, total, at = head
        tail = (list(values[REQUIRED_LOAD_FIELDS:]) + [None] * 4)[:4]
        delay, per_token = (_parse_optional(v) for v in tail[:2])
        drafted, accepted = (None if v is None else int(v) for v in map(_parse_optional, tail[2:]))
        return cls(int(r), int(w), int(free), int(total), float(at), delay, per_token, drafted,
                   accepted)


def _optional_float(value: Optional[float]) -> str:
    return "" if value is None else repr(float(value))


def _optional_int(value: Optional[int]) -> str:
    return "" if value is None else str(int(value))


def _parse_optional(value) -> Optional[float]:
    if value is None or value is False or value == "" or value == b"":
        return None
    out = float(value)
    if not out >= 0:  # also NaN
        raise ValueError(f"load forecast must be a number >= 0, got {value!r}")
    return out


@dataclass(frozen=True)
class IndexKeys:
    """Key names under one namespace. Block hashes are ``HASH_BYTES``-long ``bytes``, keyed raw."""

    namespace: str = DEFAULT_NAMESPACE

    @property
    def block_prefix(self) -> str:
        return f"{self.namespace}block:"

    def block(self, block_hash: bytes) -> bytes:
        return self.block_prefix.encode() + block_hash

    @property
    def held_prefix(self) -> str:
        return f"{self.namespace}held:"

    def held(self, replica_id: str) -> str:
        return f"{self.held_prefix}{replica_id}"

    @property
    def tier_epochs(self) -> str:
        return f"{self.namespace}tier_epochs"

    def tier_held(self, tier_id: str) -> str:
        return f"{self.namespace}tier_held:{tier_id}"

    def adapters(self, model: str) -> str:
        return f"{self.namespace}adapters:{model}"

    def tenant_inflight(self, tenant: str) -> str:
        return f"{self.namespace}tenant_inflight:{tenant}"

    @property
    def tenant_service(self) -> str:
        return f"{self.namespace}tenant_service"

    @property
    def sweep_cursor(self) -> str:
        return f"{self.namespace}sweep_cursor"

    @property
    def events(self) -> str:
        return f"{self.namespace}kv_events"

    @property
    def events_seq(self) -> str:
        return f"{self.namespace}kv_events_seq"

    @property
    def events_origin(self) -> str:
        return f"{self.namespace}kv_events_origin"

    @property
    def epochs(self) -> str:
        return f"{self.namespace}epochs"

    @property
    def registry(self) -> str:
        return f"{self.namespace}registry"

    @property
    def heartbeats(self) -> str:
        return f"{self.namespace}heartbeats"

    @property
    def load_prefix(self) -> str:
        return f"{self.namespace}load:"

    def load(self, replica_id: str) -> str:
        return f"{self.load_prefix}{replica_id}"

    @property
    def router_prefix(self) -> str:
        return f"{self.namespace}router:"

    def router(self, router_id: str) -> str:
        return f"{self.router_prefix}{router_id}"


TIER_ID_PREFIX = "tier:"


def tier_id(node_id: str) -> str:
    """The index's name for the host KV tier of Ray node ``node_id``."""
    return f"{TIER_ID_PREFIX}{node_id}"


def tier_node(tier: str) -> str:
    """The Ray node of host tier ``tier`` (the inverse of :func:`tier_id`).

    Raises:
        ValueError: ``tier`` is not a tier id.
    """
    if not tier.startswith(TIER_ID_PREFIX) or len(tier) == len(TIER_ID_PREFIX):
        raise ValueError(f"not a host tier id: {tier!r}")
    return tier[len(TIER_ID_PREFIX):]


def pack_chain(hashes: Sequence[bytes]) -> bytes:
    """Block hashes concatenated into one script argument (each exactly ``HASH_BYTES`` long)."""
    packed = b"".join(hashes)
    assert len(packed) == HASH_BYTES * len(hashes), "block hashes must be HASH_BYTES long"
    return packed


def unpack_chain(packed: bytes) -> list[bytes]:
    """Inverse of :func:`pack_chain` (how KV event-log entries carry their hashes)."""
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def seconds_to_ms(seconds: float) -> int:
    """A TTL in seconds as whole milliseconds (at least 1)."""
    return max(1, int(round(seconds * 1000)))


# What "Redis is unreachable" looks like from redis-py and asyncio (BusyLoadingError is a ConnectionError).
REDIS_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


def redis_host(url: str) -> str:
    """``host:port`` of a Redis URL (no credentials, no database): safe to show."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.hostname or ''}:{parts.port or 6379}"


def redis_client(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, binary: bool = False,
                 read_timeout_s: float | None = None) -> aioredis.Redis:
    """An asyncio client that fails fast: socket timeouts ``timeout_s`` seconds (reads:
    ``read_timeout_s`` when given, for blocking reads), one immediate retry. Replies are ``str``,
    or raw ``bytes`` with ``binary``."""
    return aioredis.Redis.from_url(
        url, socket_timeout=read_timeout_s or timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1), decode_responses=not binary,
    )
