"""Per-tenant in-flight limits over every router of a namespace, with a local lease.

A tenant's limit (the key file's ``tenant_limits``, its ``default_tenant_share`` of the fleet,
or ``--tenant-max-inflight``) holds across the fleet: each router counts the tenant's requests
in one Redis sorted set, ``{ns}tenant_inflight:{tenant}`` (:mod:`kvfleet.index_keys`), member
``{router_id}/{lease id}`` scored with the end of its lease (Redis time, ms). Admission is one
script call (:data:`ACQUIRE_LUA`): drop expired members, count, add if under the limit. The
router renews its members every ``lease_s / 3`` seconds and removes each when its stream ends
(done, failed or cancelled), so a router that dies leaks nothing: its members expire a lease
later, and the key itself (PEXPIRE = the lease) when no router renews it.

Redis is never needed to serve: when it does not answer, admission falls back to this
router's own count against the same limit (a per-router limit: the *local lease*) until the
background loop, trying every ``down_retry_s``, reaches Redis again — no request waits on a
Redis that is down, past the one that found it down. Requests admitted meanwhile are added
to the shared set by that renewal, so they count once Redis is back; a member released while
a renewal was on its way is removed again after it (the renewal re-added it).

Each finished request's service — uncached prompt tokens × 1 + output tokens × 2, the worker
scheduler's weights (:mod:`kvfleet.service_weights`) — is summed per tenant here
and added to ``{ns}tenant_service`` (a HASH, tenant → service: the fleet's per-tenant account)
by the next renewal, so the account costs no call per request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import Optional

from redis.exceptions import RedisError

from kvfleet.errors import ResourceExhausted
from kvfleet.index_keys import (
    DEFAULT_NAMESPACE,
    DEFAULT_TIMEOUT_S,
    REDIS_DOWN_ERRORS,
    IndexKeys,
    redis_client,
    seconds_to_ms,
)
from kvfleet.router.capacity import check_tenant
from kvfleet.router.prefix_index import _NOW_MS
from kvfleet.service_weights import DECODE_WEIGHT, PREFILL_WEIGHT

log = logging.getLogger(__name__)

LEASE_S = 10.0          # a member no router renews is dropped this long after its last renewal
DOWN_RETRY_S = 1.0      # while Redis is down, try it again this often (in the background)
SERVICE_TTL_S = 86400.0  # {ns}tenant_service is dropped a day after its last write
# What a failed call looks like (unreachable, too slow, or refusing: e.g. out of memory).
REDIS_FAILED = (RedisError, *REDIS_DOWN_ERRORS)

ACQUIRE_LUA = _NOW_MS + """
-- KEYS[1] the tenant's in-flight ZSET; ARGV[1] limit, ARGV[2] lease (ms), ARGV[3] member.
-- Returns {1, count} when admitted (count includes it), {0, count} when at the limit.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return {0, n} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, n + 1}
"""

RENEW_LUA = _NOW_MS + """
-- KEYS[1] the service HASH, KEYS[2..] in-flight ZSETs; ARGV[1] lease (ms), ARGV[2] the service
-- hash's TTL (ms), ARGV[3] n: then n (tenant, service to add) pairs, then for each ZSET: its
-- member count and the members.
local lease = tonumber(ARGV[1])
local n = tonumber(ARGV[3])
for j = 0, n - 1 do redis.call('HINCRBYFLOAT', KEYS[1], ARGV[4 + 2 * j], ARGV[5 + 2 * j]) end
if n > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
local i = 4 + 2 * n
for k = 2, #KEYS do
  local m = tonumber(ARGV[i])
  for j = 1, m do redis.call('ZADD', KEYS[k], now + lease, ARGV[i + j]) end
  i = i + m + 1
  redis.call('PEXPIRE', KEYS[k], lease)
end
return #KEYS - 1
"""

RELEASE_LUA = """
-- KEYS[1] the tenant's in-flight ZSET; ARGV[1] the member. The key goes with its last member.
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[1]) end
return 1
"""


def request_service(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
    """Service of one finished request: computed prompt tokens and output tokens, weighted."""
    return (PREFILL_WEIGHT * max(0, prompt_tokens - cached_tokens)
            + DECODE_WEIGHT * output_tokens)


@dataclass(frozen=True)
class Lease:
    """One admitted request; ``member`` is its name in the shared set ("" = not limited)."""

    tenant: str
    member: str


class TenantLimiter:
    """Admits requests per tenant against a limit shared by every router of ``namespace``.

    ``redis_url`` None: this router's count only (unit tests, or a fleet without Redis).
    ``inflight``: this router's open requests by tenant. Call :meth:`start` on the event loop
    (renewals), :meth:`close` at shutdown.
    """

    def __init__(self, redis_url: Optional[str] = None, namespace: str = DEFAULT_NAMESPACE,
                 *, router_id: str = "", lease_s: float = LEASE_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, down_retry_s: float = DOWN_RETRY_S
                 ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.inflight: collections.Counter[str] = collections.Counter()
        self._keys = IndexKeys(namespace)
        self._lease_ms = seconds_to_ms(lease_s)
        self._renew_s = lease_s / 3
        self._down_retry_s = down_retry_s
        self._down = False  # set by a failed call, cleared by the background loop's success
        self._held: dict[str, set[str]] = {}  # tenant -> this router's members (limited ones)
        self._unsent: dict[str, float] = {}  # tenant -> service not yet added to the account
        self._releases: set[asyncio.Task] = set()
        self._renewer: Optional[asyncio.Task] = None
        self._redis = redis_client(redis_url, timeout_s) if redis_url else None
        if self._redis is not None:
            self._acquire = self._redis.register_script(ACQUIRE_LUA)
            self._renew = self._redis.register_script(RENEW_LUA)
            self._release = self._redis.register_script(RELEASE_LUA)

    @property
    def shared(self) -> bool:
        """Limits are counted across routers now (Redis configured and not marked down)."""
        return self._redis is not None and not self._down

    def start(self) -> None:
        if self._redis is not None and self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever())

    async def acquire(self, tenant: str, limit: Optional[int]) -> Lease:
        """Admit one request of ``tenant`` (``limit``: in-flight requests it may hold, None =
        unlimited); one Redis round trip when limited and Redis answers. Every lease must be
        given back with :meth:`release`.

        Raises:
            ResourceExhausted: the tenant holds ``limit`` requests across the fleet (or, while
                Redis does not answer, on this router).
        """
        if limit is None:
            self.inflight[tenant] += 1
            return Lease(tenant, "")
        member = f"{self.router_id}/{uuid.uuid4().hex[:12]}"
        # Counted here before the await: a burst on this router cannot all pass the local check.
        local = self.inflight[tenant]
        self.inflight[tenant] += 1
        try:
            if self.shared:
                try:
                    admitted, count = await self._acquire(
                        keys=[self._keys.tenant_inflight(tenant)],
                        args=[limit, self._lease_ms, member])
                    if not admitted:
                        raise ResourceExhausted(
                            f"tenant {tenant!r} is at its limit of {limit} in-flight requests "
                            f"across the fleet ({count} held)")
                except REDIS_FAILED as exc:
                    self._mark_down(exc)
                    check_tenant(tenant, local, limit)
            else:
                check_tenant(tenant, local, limit)
        except BaseException:
            self._forget_local(tenant)
            raise
        self._held.setdefault(tenant, set()).add(member)
        return Lease(tenant, member)

    def release(self, lease: Lease, service: float = 0.0) -> None:
        """Give ``lease`` back: call it once, in a ``finally``. Never blocks or raises: the
        Redis update runs in the background, and if it fails the member expires with its
        lease. ``service``: the request's weighted tokens (:func:`request_service`), added to
        the tenant's account with the next renewal."""
        self._forget_local(lease.tenant)
        held = self._held.get(lease.tenant)
        if held is not None:
            held.discard(lease.member)
            if not held:
                del self._held[lease.tenant]
        if service > 0 and self._redis is not None:
            self._unsent[lease.tenant] = self._unsent.get(lease.tenant, 0.0) + service
        if self._redis is None or not lease.member:
            return
        self._remove_in_background(lease)

    async def settle(self) -> None:
        """Until every release so far has reached Redis (or failed), and the account too."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)
        if self._unsent and self._redis is not None:
            await self.renew()
            while self._releases:  # members the renewal re-added after their release
                await asyncio.gather(*list(self._releases), return_exceptions=True)

    async def service(self) -> dict[str, float]:
        """The fleet's per-tenant service account. Raises the Redis client's errors."""
        assert self._redis is not None, "no Redis: no fleet account"
        raw = await self._redis.hgetall(self._keys.tenant_service)
        return {str(k): float(v) for k, v in raw.items()}

    async def close(self) -> None:
        """Stop renewing; let pending releases finish (they are bounded by the timeout)."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        await self.settle()
        if self._redis is not None:
            await self._redis.aclose()

    # ---- internals ------------------------------------------------------------------------
    def _forget_local(self, tenant: str) -> None:
        self.inflight[tenant] -= 1
        if self.inflight[tenant] <= 0:
            del self.inflight[tenant]

    def _mark_down(self, exc: BaseException) -> None:
        if not self._down:
            log.warning("tenant limits: Redis did not answer (%s); limits are per router "
                        "until it does", type(exc).__name__)
        self._down = True

    def _remove_in_background(self, lease: Lease) -> None:
        """Remove ``lease``'s member from the shared set in a task (never blocks)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # finalized off the loop: the member expires with its lease
            return
        task = loop.create_task(self._release_in_redis(lease))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_in_redis(self, lease: Lease) -> None:
        try:
            await self._release(keys=[self._keys.tenant_inflight(lease.tenant)],
                                args=[lease.member])
        except REDIS_FAILED as exc:
            self._mark_down(exc)  # the member expires with its lease

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._down_retry_s if self._down else self._renew_s)
            if self._held or self._down or self._unsent:
                await self.renew()

    async def renew(self) -> None:
        """Extend the lease of every member this router holds (adding those admitted while
        Redis was down) and add the service summed since the last call to the account; a
        success ends a Redis outage. Never raises for Redis (the service is kept to retry)."""
        assert self._redis is not None
        unsent, self._unsent = self._unsent, {}
        keys: list[str] = [self._keys.tenant_service]
        args: list[int | float | str] = [self._lease_ms, seconds_to_ms(SERVICE_TTL_S), len(unsent)]
        for tenant, service in unsent.items():
            args += [tenant, service]
        sent = {tenant: set(members) for tenant, members in self._held.items()}
        for tenant, members in sent.items():
            keys.append(self._keys.tenant_inflight(tenant))
            args += [len(members), *sorted(members)]
        try:
            await self._renew(keys=keys, args=args)
        except REDIS_FAILED as exc:
            for tenant, service in unsent.items():  # kept for the next try
                self._unsent[tenant] = self._unsent.get(tenant, 0.0) + service
            self._mark_down(exc)
            return
        # A member released while the call was on its way (a renewal that waited for a
        # restarting Redis, or one overtaken by the release's own call) was just added back:
        # remove it again, after the renewal, or it holds a place for a whole lease.
        for tenant, members in sent.items():
            for member in members - self._held.get(tenant, set()):
                self._remove_in_background(Lease(tenant, member))
        if self._down:
            log.info("tenant limits: Redis answers again; limits are fleet-wide")
        self._down = False
