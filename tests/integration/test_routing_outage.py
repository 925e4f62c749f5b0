"""Redis is an index, not the source of truth: killed mid-run, requests are still served (by
load over the replicas the router knew); when it returns, routing by prefix resumes."""

from __future__ import annotations

import asyncio
import logging
import time

from kvfleet.deploy.redis_server import start_redis
from tests.integration.routing_fleet import BLOCK, Fleet, prompt


async def test_redis_killed_mid_run_requests_still_served_then_recover(tiny_llama_dir, caplog,
                                                                       monkeypatch):
    redis = start_redis()  # our own: this test kills it
    port = redis.port
    fleet = Fleet(redis.url, "outage:", str(tiny_llama_dir))
    try:
        await fleet.add_replica("rep-a")
        await fleet.add_replica("rep-b")
        router = await fleet.add_router()
        await fleet.wait_replicas(2)
        tokens = prompt(7, 4 * BLOCK + 3)
        first = await fleet.generate(tokens)
        await fleet.wait_match(fleet.chain(tokens), {first.replica_id: 4})
        assert (await fleet.generate(tokens)).usage.cached_prompt_tokens == 4 * BLOCK

        caplog.set_level(logging.WARNING, logger="kvfleet.router.replica_set")
        redis.stop()
        await router.replicas.refresh()  # its periodic registry read finds Redis gone
        lookups = []
        index, match = router.replicas.index, router.replicas.index.match

        async def counted_match(chain):
            lookups.append(len(chain))
            return await match(chain)

        monkeypatch.setattr(index, "match", counted_match)
        served = []
        for i in range(8):  # mid-run: every request is still answered, none waits on Redis
            served.append((await fleet.generate(prompt(100 + i, 2 * BLOCK))).replica_id)
        assert lookups == []  # none waits on Redis: the lookup is skipped during the outage
        monkeypatch.undo()
        # By load over the known replicas: idle, one request at a time, equal loads take turns.
        assert sorted(served) == ["rep-a"] * 4 + ["rep-b"] * 4
        assert not router.replicas.index_available
        outage_logs = [r for r in caplog.records if r.name == "kvfleet.router.replica_set"
                       and "unreachable" in r.getMessage()]
        assert len(outage_logs) == 1  # logged once per outage, not per request

        redis = start_redis(port=port)  # back, empty: replicas re-register, republish
        await router.replicas.refresh()  # even before they have: the known list is kept
        assert (await fleet.generate(prompt(200, 2 * BLOCK))).replica_id in ("rep-a", "rep-b")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if router.replicas.index_available and len(await fleet.index().replicas()) == 2 \
                    and await fleet.match(fleet.chain(tokens)) == {first.replica_id: 4}:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the index did not recover")
        again = await fleet.generate(tokens)
        assert again.replica_id == first.replica_id
        assert again.usage.cached_prompt_tokens == 4 * BLOCK
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        await fleet.stop()
        redis.stop()
