"""Fleet-wide tenant limits (kvfleet.router.tenant_limits) against a real private
redis-server: two limiters (two routers) share one limit, nothing stays in Redis after the
leases end, a router that vanishes leaks nothing, and a Redis outage falls back to
per-router limits (a local lease) instead of failing."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.deploy.redis_server import free_port, start_redis
from kvfleet.errors import ResourceExhausted
from kvfleet.index_keys import redis_client
from kvfleet.router.tenant_limits import TenantLimiter, request_service


async def _keys(url: str, namespace: str) -> list[str]:
    r = redis_client(url)
    try:
        return sorted([k async for k in r.scan_iter(match=namespace + "*")])
    finally:
        await r.aclose()


async def test_two_routers_share_one_tenant_limit_and_leave_no_keys(redis_server, redis_namespace):
    a = TenantLimiter(redis_server.url, redis_namespace)
    b = TenantLimiter(redis_server.url, redis_namespace)
    try:
        a1, b1, a2 = (await a.acquire("acme", 3), await b.acquire("acme", 3),
                      await a.acquire("acme", 3))
        for limiter in (a, b):  # 2 on a, 1 on b: a per-router limit of 3 would admit both
            with pytest.raises(ResourceExhausted, match="limit of 3 in-flight requests across "
                                                        "the fleet"):
                await limiter.acquire("acme", 3)
        other = await b.acquire("globex", 3)  # another tenant has its own count
        assert a.inflight == {"acme": 2} and b.inflight == {"acme": 1, "globex": 1}
        a.release(a1, service=request_service(16, 12, 3))  # 4 computed + 3 output tokens
        await a.settle()
        b2 = await b.acquire("acme", 3)  # the freed place, taken through the other router
        a.release(a2)
        for lease in (b1, b2, other):
            b.release(lease)
        await a.settle()
        await b.settle()
        assert not a.inflight and not b.inflight
        assert await _keys(redis_server.url, redis_namespace) == [redis_namespace + "tenant_service"]
        assert await a.service() == {"acme": 4 + 2 * 3}
    finally:
        await a.close()
        await b.close()


async def test_a_router_that_vanishes_holds_its_places_only_for_its_lease(redis_server,
                                                                          redis_namespace):
    gone = TenantLimiter(redis_server.url, redis_namespace, lease_s=0.3)  # never renews
    live = TenantLimiter(redis_server.url, redis_namespace)
    try:
        await gone.acquire("acme", 1)
        with pytest.raises(ResourceExhausted):
            await live.acquire("acme", 1)
        while True:  # the lease ends; the next admission drops the expired member
            try:
                lease = await live.acquire("acme", 1)
                break
            except ResourceExhausted:
                await asyncio.sleep(0.05)
        live.release(lease)
        await live.settle()
        assert await _keys(redis_server.url, redis_namespace) == []
    finally:
        await gone.close()
        await live.close()


async def test_unreachable_redis_falls_back_to_a_per_router_limit():
    limiter = TenantLimiter(f"redis://127.0.0.1:{free_port()}/0", "kvtest:", timeout_s=0.2)
    try:
        held = [await limiter.acquire("acme", 2) for _ in range(2)]  # served: a local lease
        assert not limiter.shared
        with pytest.raises(ResourceExhausted, match="on this router"):
            await limiter.acquire("acme", 2)
        for lease in held:
            limiter.release(lease)
        await limiter.settle()
        assert not limiter.inflight
        assert (await limiter.acquire("acme", None)).member == ""  # unlimited: no Redis at all
    finally:
        await limiter.close()


async def test_admissions_during_an_outage_count_fleet_wide_once_redis_is_back():
    server = start_redis()
    port, url, ns = server.port, server.url, "kvtest-outage:"
    a = TenantLimiter(url, ns, down_retry_s=0.05, timeout_s=0.2)
    b = TenantLimiter(url, ns, down_retry_s=0.05, timeout_s=0.2)
    a.start()
    b.start()
    try:
        first = await a.acquire("acme", 2)
        server.stop()
        second = await a.acquire("acme", 2)  # Redis down: admitted on a's own count
        assert not a.shared
        server = start_redis(port=port)  # an empty Redis on the same address
        while not a.shared:  # a's background loop reaches it and re-adds both of its leases
            await asyncio.sleep(0.05)
        with pytest.raises(ResourceExhausted, match="across the fleet"):
            await b.acquire("acme", 2)
        a.release(first)
        a.release(second)
        await a.settle()
        assert await _keys(url, ns) == []
        lease = await b.acquire("acme", 2)  # both places free again, fleet-wide
        b.release(lease)
        await b.settle()
    finally:
        await a.close()
        await b.close()
        server.stop()


async def test_a_renewal_in_flight_never_resurrects_a_released_lease(redis_server,
                                                                      redis_namespace):
    # The renewal that reaches a restarted Redis (it retries while Redis is down) carries the
    # members held when it was sent; one released meanwhile must not hold a place after it.
    a = TenantLimiter(redis_server.url, redis_namespace)
    b = TenantLimiter(redis_server.url, redis_namespace)
    renew, sent, go = a._renew, asyncio.Event(), asyncio.Event()

    async def delayed_renew(**kw):  # on its way while the release runs
        sent.set()
        await go.wait()
        return await renew(**kw)

    a._renew = delayed_renew
    try:
        lease = await a.acquire("acme", 1)
        renewal = asyncio.create_task(a.renew())
        await sent.wait()
        a.release(lease)
        while a._releases:  # the release reached Redis first
            await asyncio.gather(*list(a._releases))
        go.set()
        await renewal
        await a.settle()
        again = await b.acquire("acme", 1)  # the place is free across the fleet
        b.release(again)
        await b.settle()
        assert await _keys(redis_server.url, redis_namespace) == []
    finally:
        await a.close()
        await b.close()
