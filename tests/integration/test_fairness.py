"""Tenant fairness: one tenant floods at 10x the fleet's capacity through two routers sharing
one Redis; another tenant sending within its share is admitted every time."""

from __future__ import annotations

import asyncio
import collections
import json
from dataclasses import replace

import grpc

from kvfleet.index_keys import redis_client
from kvfleet.v1 import router_pb2, router_pb2_grpc
from tests.integration.routing_fleet import prompt
from tests.integration.test_overload import SLOW, TIGHT, _outcome
from tests.integration.test_worker_stream import idle

SHARED = replace(TIGHT, tenant_share=0.5)  # 6 sequences per replica, 3 per tenant


def _request(seed: int, max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt(seed, 40))
    req.sampling.max_tokens, req.sampling.ignore_eos = max_tokens, True
    return req


async def test_a_flooding_tenant_never_crowds_out_one_within_its_share(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"key-flood": "flood", "key-steady": "steady"},
                                "default_tenant_share": 0.5}))
    servers = [await fleet.add_replica(rid, cost_model=SLOW, scheduler=SHARED)
               for rid in ("rep-a", "rep-b")]
    routers = [await fleet.add_router(api_keys_file=str(keys)) for _ in range(2)]
    await fleet.wait_replicas(2)
    channels = [grpc.aio.insecure_channel(r.address) for r in routers]
    stubs = [router_pb2_grpc.RouterStub(c) for c in channels]
    flood_md, steady_md = ((("authorization", f"Bearer key-{t}"),) for t in ("flood", "steady"))
    done = asyncio.Event()
    flood: list[str] = []

    async def flooder(i: int) -> None:  # 10x capacity of clients, retrying after a refusal
        while not done.is_set():
            code, *_ = await _outcome(stubs[i % 2].Generate(_request(i, 20), metadata=flood_md))
            flood.append(code)
            if code != "OK":
                await asyncio.sleep(0.02)

    async def steady(i: int) -> list[str]:  # one request at a time through each router
        codes = []
        for j in range(4):
            code, *_ = await _outcome(stubs[i].Generate(_request(1000 + 10 * i + j, 5),
                                                        metadata=steady_md))
            codes.append(code)
        return codes

    try:
        flooders = [asyncio.create_task(flooder(i)) for i in range(10 * 2 * SHARED.max_sequences)]
        await asyncio.sleep(0.5)  # the flood has filled its share everywhere
        steady_codes = await asyncio.gather(steady(0), steady(1))
        done.set()
        await asyncio.gather(*flooders)
    finally:
        for c in channels:
            await c.close()
    assert [c for codes in steady_codes for c in codes] == ["OK"] * 8
    counts = collections.Counter(flood)
    assert set(counts) == {"OK", "RESOURCE_EXHAUSTED"}, counts
    for server in servers:
        stats = await idle(server)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert server.service.reservations.count == 0


async def test_a_burst_never_holds_more_than_the_tenant_limit(fleet, tmp_path):
    # Issue 24 item 11: the limit was checked before an await (the index lookup) and counted
    # after it, so a burst all passed the check.
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"key-burst": "burst"}, "tenant_limits": {"burst": 2}}))
    await fleet.add_replica("rep-a", cost_model=SLOW)
    router = await fleet.add_router(api_keys_file=str(keys), index_mirror=False)  # awaits Redis
    await fleet.wait_replicas(1)
    md = (("authorization", "Bearer key-burst"),)
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        outs = await asyncio.gather(*(_outcome(stub.Generate(_request(i, 10), metadata=md))
                                      for i in range(8)))
    codes = collections.Counter(code for code, *_ in outs)
    assert codes == {"OK": 2, "RESOURCE_EXHAUSTED": 6}, codes
    assert router.core.tenant_inflight["burst"] == 0


async def test_members_of_a_shared_namespace_each_get_their_own_share(fleet, tmp_path):
    # Issue 24 item 10: the worker counted fairness by the cache scope ("@docs"), so the
    # members of one shared namespace shared one tenant_share.
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"key-a": "a", "key-b": "b"},
                                "shared_namespaces": {"docs": ["a", "b"]}}))
    server = await fleet.add_replica("rep-a", cost_model=SLOW, scheduler=SHARED)
    router = await fleet.add_router(api_keys_file=str(keys))
    await fleet.wait_replicas(1)
    md = {t: (("authorization", f"Bearer key-{t}"),) for t in ("a", "b")}
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        share = SHARED.max_sequences // 2
        holders = [asyncio.ensure_future(_outcome(stub.Generate(_request(0, 40), metadata=md["a"])))
                   for _ in range(share)]
        while server.service.reservations.count < share:
            await asyncio.sleep(0.01)
        code, details, _, _ = await _outcome(stub.Generate(_request(1, 2), metadata=md["a"]))
        assert code == "RESOURCE_EXHAUSTED" and "'a' holds its share" in details
        last = None
        async for msg in stub.Generate(_request(0, 2), metadata=md["b"]):
            last = msg  # another member: its own share, and the namespace's cached blocks
        assert last.usage.cached_prompt_tokens > 0
        assert [c for c, *_ in await asyncio.gather(*holders)] == ["OK"] * share


async def test_two_routers_enforce_one_tenant_limit_between_them(fleet, tmp_path):
    # Issue 25 §3: the limit is counted in Redis ({ns}tenant_inflight:{tenant}), so a burst
    # split over two routers gets the limit once, not once per router.
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"key-burst": "burst"}, "tenant_limits": {"burst": 2}}))
    await fleet.add_replica("rep-a", cost_model=SLOW)
    routers = [await fleet.add_router(api_keys_file=str(keys)) for _ in range(2)]
    await fleet.wait_replicas(1)
    md = (("authorization", "Bearer key-burst"),)
    channels = [grpc.aio.insecure_channel(r.address) for r in routers]
    try:
        stubs = [router_pb2_grpc.RouterStub(c) for c in channels]
        outs = await asyncio.gather(*(_outcome(stubs[i % 2].Generate(_request(i, 10), metadata=md))
                                      for i in range(8)))
        codes = collections.Counter(code for code, *_ in outs)
        assert codes == {"OK": 2, "RESOURCE_EXHAUSTED": 6}, codes
        assert any("across the fleet" in details for _, details, *_ in outs)
        # A stream cancelled mid-way and a request refused after admission give theirs back.
        call = stubs[0].Generate(_request(50, 40), metadata=md)
        async for _ in call:
            break
        call.cancel()
        bad = router_pb2.GenerateRequest()
        bad.token_ids.ids.extend([10**9])  # outside the vocabulary: INVALID_ARGUMENT
        code, *_ = await _outcome(stubs[1].Generate(bad, metadata=md))
        assert code == "INVALID_ARGUMENT"
    finally:
        for c in channels:
            await c.close()
    for r in routers:
        while r.core.tenant_inflight["burst"]:
            await asyncio.sleep(0.01)
        await r.core.tenant_limiter.settle()
    redis = redis_client(fleet.redis_url)
    try:
        left = [k async for k in redis.scan_iter(match=fleet.namespace + "tenant_inflight:*")]
        account = await redis.hgetall(fleet.namespace + "tenant_service")
    finally:
        await redis.aclose()
    assert left == []
    assert float(account["burst"]) > 0  # the finished requests' service, fleet-wide
