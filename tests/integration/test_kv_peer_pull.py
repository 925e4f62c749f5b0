"""Issue 26 §2 on real replicas: replica B, told by a hint that replica A holds a prompt's
prefix, pulls it through Ray (A writes it to the node's host tier actor, B restores it) and
serves the prompt with cached tokens it never computed; with A stalled mid-transfer, then
gone, B recomputes, and neither pool blocks nor object references leak. Through a real
router: a request routed away from its busy holder carries the hint, and is served pulled."""

from __future__ import annotations

import asyncio

import grpc

from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.kv_tier.node_tier import remove_node_tiers
from kvfleet.worker.replica.replica import ReplicaServer
from kvfleet.worker.step_cost.model import CostModel, StepCost
from tests.integration.routing_fleet import prompt, running_fleet
from tests.integration.test_kv_hand_over import _config
from tests.unit.worker.kv_tier.test_tier_faults import _live_refs

# The tiny model prefills 32 tokens in milliseconds: price recompute high so the pull is
# worth it, as it is for a long prefix of a real model.
EXPENSIVE = StepCost(CostModel(1.0, 1.0, 1.0, "test: 1 s a token"), alpha=0.0)


def _prompt(seed: int) -> list[int]:
    return [(7 * i + seed) % 1000 + 5 for i in range(40)]  # 2 full blocks of 16 reusable


def hinted_request(rid: str, tokens: list[int],
                   peer: ReplicaServer | None = None) -> worker_pb2.WorkerGenerateRequest:
    """2 tokens of ``tokens``, with a hint naming ``peer`` as the holder of 2 full blocks."""
    req = worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=tokens,
                                           tenant="default")
    req.sampling.max_tokens = 2
    req.sampling.ignore_eos = True
    if peer is not None:
        req.peer.replica_id, req.peer.address, req.peer.num_blocks = "a", peer.address, 2
    return req


async def _cached_tokens(server: ReplicaServer, rid: str, tokens: list[int],
                         peer: ReplicaServer | None = None) -> int:
    async with grpc.aio.insecure_channel(server.address) as channel:
        req = hinted_request(rid, tokens, peer)
        last = None
        async for m in worker_pb2_grpc.WorkerStub(channel).Generate(req):
            last = m
        assert last is not None and last.HasField("usage") and len(last.token_ids) >= 1
        return last.usage.cached_prompt_tokens


async def test_a_replica_pulls_a_peers_prefix_and_recomputes_when_the_peer_fails(
        ray_session, tiny_llama_dir, redis_server, redis_namespace) -> None:
    a = ReplicaServer(_config("a", tiny_llama_dir, redis_server.url, redis_namespace))
    b = ReplicaServer(_config("b", tiny_llama_dir, redis_server.url, redis_namespace))
    try:
        await a.start()
        await b.start()
        puller = b.service.puller
        assert puller is not None
        puller.step_cost = EXPENSIVE
        assert await _cached_tokens(a, "a-1", _prompt(3)) == 0
        assert await _cached_tokens(b, "b-1", _prompt(3), peer=a) == 32  # pulled, restored
        assert puller.stats.pulls == 1 and puller.stats.pulled_blocks == 2
        assert b.engine.executor.tier.stats.restores == 2
        assert a.engine.exports.exported_blocks == 2

        refs_before = _live_refs(ray_session)
        puller.max_timeout_s = 1.0
        a._loop.engine.exports.request = _never_done  # A stalls mid-transfer
        assert await _cached_tokens(a, "a-2", _prompt(4)) == 0
        assert await _cached_tokens(b, "b-2", _prompt(4), peer=a) == 0  # gave up, recomputed
        await a.stop()  # A gone: unreachable
        assert await _cached_tokens(b, "b-3", _prompt(5), peer=a) == 0
        assert puller.stats.failed == 2 and puller.stats.pulls == 1
        assert await _idle(b)  # nothing held on B
        assert _live_refs(ray_session) <= refs_before
    finally:
        await a.stop()
        await b.stop()
        remove_node_tiers(redis_namespace)


async def _idle(server: ReplicaServer) -> bool:
    """Every pool block free in the engine's stats (taken after each step: the last step's
    may land just after its final message)."""
    for _ in range(100):
        stats = server.service.loop.stats
        if stats["num_free_blocks"] == stats["num_total_blocks"] and not stats["running"]:
            return True
        await asyncio.sleep(0.05)
    return False


def _never_done(hashes, done) -> int:
    """An export that reached the engine and never finishes (its replica hung)."""
    return 0


async def test_the_router_hints_the_holder_it_routes_away_from_and_the_replica_pulls(
        ray_session, tiny_llama_dir, redis_server, redis_namespace) -> None:
    tier = {"executor": "model", "cost_model": None, "kv_host_memory_bytes": 16 << 20}
    async with running_fleet(redis_server.url, redis_namespace, str(tiny_llama_dir)) as fleet:
        try:
            await fleet.add_replica("rep-a", **tier)
            b = await fleet.add_replica("rep-b", **tier)
            router = await fleet.add_router()
            await fleet.wait_replicas(2)
            b.service.puller.step_cost = EXPENSIVE
            # Long enough that recomputing its 12 full blocks (193 s at EXPENSIVE) beats
            # waiting out half of busy A's 256-token step (128.5 s) plus the pull.
            tokens = prompt(11, 200)
            await fleet.direct("rep-a", tokens)  # A holds the prompt's 12 full blocks
            await fleet.wait_match(fleet.chain(tokens), {"rep-a": 12})
            router.core.replicas.ledger.inflight["rep-a"] += 50  # A looks busy: go to B
            final = await fleet.generate(tokens, max_tokens=2)
            router.core.replicas.ledger.inflight["rep-a"] -= 50
            assert final.replica_id == "rep-b"
            assert final.usage.cached_prompt_tokens == 192  # pulled from A, never computed on B
            assert b.service.puller.stats.pulls == 1
        finally:
            await fleet.stop()
            remove_node_tiers(redis_namespace)
