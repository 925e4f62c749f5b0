"""Issue 26 §3 on real replicas: two replicas of one node share its host KV tier (a Ray actor);
draining the first hands its cached blocks over, and the second then serves the same prompt
from them (cached prompt tokens it never computed). A third replica started afterwards with
``kv_prewarm_s`` restores them into its device pool before it registers: the index shows them
on its device, and it serves the prompt without restoring anything."""

from __future__ import annotations

import asyncio

import grpc

from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.prefix_index import RedisPrefixIndex
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.kv_tier.node_tier import node_tier, remove_node_tiers
from kvfleet.worker.replica.replica import ReplicaConfig, ReplicaServer

PROMPT = [(7 * i + 3) % 1000 + 5 for i in range(40)]  # 2 full blocks of 16 reusable


def _config(rid: str, model_dir, redis_url: str, namespace: str,
            prewarm_s: float = 0.0) -> ReplicaConfig:
    return ReplicaConfig(replica_id=rid, model_name="tiny", model_dir=str(model_dir), block_size=16,
                         num_blocks=32, one_row_weights=False, redis_url=redis_url,
                         namespace=namespace, heartbeat_interval_s=0.2, drain_timeout_s=5.0,
                         kv_host_memory_bytes=16 << 20, kv_prewarm_s=prewarm_s,
                         scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))


async def _cached_tokens(server: ReplicaServer, rid: str) -> int:
    async with grpc.aio.insecure_channel(server.address) as channel:
        req = worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=PROMPT,
                                               tenant="default")
        req.sampling.max_tokens = 2
        req.sampling.ignore_eos = True
        last = None
        async for m in worker_pb2_grpc.WorkerStub(channel).Generate(req):
            last = m
        assert last is not None and last.HasField("usage")
        return last.usage.cached_prompt_tokens


def _no_tier_actor(namespace: str) -> None:
    """Kill a tier actor of ``namespace`` an earlier run left (a test's starts empty)."""
    remove_node_tiers(namespace)


async def test_a_drained_replicas_prefix_is_served_from_the_node_tier_by_a_survivor(
        ray_session, tiny_llama_dir, redis_server, redis_namespace) -> None:
    _no_tier_actor(redis_namespace)
    first = ReplicaServer(_config("a", tiny_llama_dir, redis_server.url, redis_namespace))
    second = ReplicaServer(_config("b", tiny_llama_dir, redis_server.url, redis_namespace))
    third = ReplicaServer(_config("c", tiny_llama_dir, redis_server.url, redis_namespace,
                                  prewarm_s=10.0))
    try:
        await first.start()
        await second.start()
        assert await _cached_tokens(first, "a-1") == 0
        await first.drain()
        assert first.handed_over_blocks == 2
        # The index shows the handed-over blocks in b's node tier (routers credit them to b).
        tier = second.publisher.replica.kv_tier
        assert tier.startswith("tier:")
        chain = block_hash_chain(root_hash(second.engine.identity_digest, "default", ""),
                                 PROMPT, 16)[:2]
        mirror = MirroredPrefixIndex(RedisPrefixIndex(redis_server.url, namespace=redis_namespace),
                                     redis_server.url, namespace=redis_namespace)
        mirror.start()
        try:
            for _ in range(100):  # the tier actor publishes every 50 ms
                await mirror.sync()
                if await mirror.host_match(chain, {"b": (tier, 0)}) == {"b": 2}:
                    break
                await asyncio.sleep(0.05)
            assert await mirror.host_match(chain, {"b": (tier, 0)}) == {"b": 2}
            assert await mirror.fallback.host_match(chain, {"b": (tier, 0)}) == {"b": 2}
        finally:
            await mirror.close()
        assert await _cached_tokens(second, "b-1") == 32  # restored, never computed on b
        assert second.engine.executor.tier.stats.restores == 2
        await _prewarmed_replica_serves_from_its_pool(third, chain, redis_server.url,
                                                      redis_namespace)
    finally:
        await first.stop()
        await second.stop()
        await third.stop()
        remove_node_tiers(redis_namespace)


async def _prewarmed_replica_serves_from_its_pool(third: ReplicaServer, chain, redis_url: str,
                                                  namespace: str) -> None:
    await third.start()  # pre-warms before it registers
    assert set(chain) <= third.engine.kv.cached_hashes()
    index = RedisPrefixIndex(redis_url, namespace=namespace)
    try:  # published with its registration: device residency, no step needed
        assert (await index.match(chain)).get("c") == 2
    finally:
        await index.close()
    assert await _cached_tokens(third, "c-1") == 32
    assert third.engine.executor.tier.stats.restores == 2  # the pre-warm's; none at admission
    assert third.engine.stats()["prefix_hits"]["device"] == 32


async def test_a_replica_drained_without_the_hand_over_leaves_its_blocks_to_no_one(
        ray_session, tiny_llama_dir, redis_server, redis_namespace) -> None:
    """``kv_hand_over=False`` (``--no-kv-hand-over``): the drain writes nothing to the node's
    tier, and the survivor recomputes the drained replica's prefix."""
    import dataclasses

    _no_tier_actor(redis_namespace)
    first = ReplicaServer(dataclasses.replace(
        _config("a", tiny_llama_dir, redis_server.url, redis_namespace), kv_hand_over=False))
    second = ReplicaServer(_config("b", tiny_llama_dir, redis_server.url, redis_namespace))
    try:
        await first.start()
        await second.start()
        assert await _cached_tokens(first, "a-1") == 0
        await first.drain()
        assert first.drained and first.handed_over_blocks == 0
        assert node_tier(16 << 20, namespace=redis_namespace).stats().blocks == 0
        assert await _cached_tokens(second, "b-1") == 0
        assert second.engine.executor.tier.stats.restores == 0
    finally:
        await first.stop()
        await second.stop()
        remove_node_tiers(redis_namespace)
