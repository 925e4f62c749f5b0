"""An in-process fleet for routing tests: cost-model replicas (real scheduler, block pool,
prefix cache, KV events, gRPC servers) and routers (real gRPC, real Redis), on one loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import grpc

from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.main import RouterConfig, RouterServer
from kvfleet.router.prefix_index import PrefixIndex
from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import ZERO
from kvfleet.worker.replica.replica import ReplicaConfig, ReplicaServer

BLOCK = 16


@dataclass
class Fleet:
    redis_url: str
    namespace: str
    model_dir: str
    model_name: str = "tiny-llama"
    replicas: dict[str, ReplicaServer] = field(default_factory=dict)
    routers: list[RouterServer] = field(default_factory=list)
    _channels: list = field(default_factory=list)

    def replica_config(self, rid: str, **kw) -> ReplicaConfig:
        base = ReplicaConfig(replica_id=rid, model_name=self.model_name, model_dir=self.model_dir,
                             block_size=BLOCK, num_blocks=64, redis_url=self.redis_url,
                             namespace=self.namespace, executor="cost-model", cost_model=ZERO,
                             heartbeat_interval_s=0.2,
                             scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
        return replace(base, **kw)

    async def add_replica(self, rid: str, **kw) -> ReplicaServer:
        server = ReplicaServer(self.replica_config(rid, **kw))
        await server.start()
        self.replicas[rid] = server
        return server

    async def add_router(self, **kw) -> RouterServer:
        """A router on this fleet's Redis; ``policy`` defaults to ``prefix_aware``, whose rules
        (rendezvous placement, load penalty, the count bound) these tests check —
        ``predicted_ttft``'s are tests/unit/router/test_predicted_ttft.py's."""
        kw.setdefault("policy", "prefix_aware")
        cfg = RouterConfig(redis_url=self.redis_url, model_name=self.model_name,
                           model_dir=self.model_dir, port=0, namespace=self.namespace, **kw)
        router = RouterServer(cfg)
        await router.start()
        self.routers.append(router)
        return router

    def chain(self, tokens: Sequence[int], scope: str = "default", salt: str = "") -> list[bytes]:
        """The chain the router computes for these tokens (its own identity)."""
        model = self.routers[0].core.models[self.model_name]
        return block_hash_chain(root_hash(model.identity.digest(), scope, salt), tokens, BLOCK)

    def index(self, router: int = 0) -> PrefixIndex:
        return self.routers[router].replicas.index

    async def match(self, chain: list[bytes], router: int = 0) -> dict[str, int]:
        """The router's index lookup once it has read every KV event written so far (the
        mirror follows the event log a few ms behind the Redis write)."""
        index = self.index(router)
        if isinstance(index, MirroredPrefixIndex):
            await index.sync()
        return await index.match(chain)

    async def wait_replicas(self, n: int, timeout_s: float = 10.0) -> None:
        """Until every router's replica set lists ``n`` live replicas."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for r in self.routers:
                await r.replicas.refresh()
            if all(len(r.replicas.replicas) == n for r in self.routers):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"routers did not see {n} replicas")

    async def wait_match(self, chain: list[bytes], expected: dict[str, int],
                         timeout_s: float = 5.0) -> None:
        """Until every router's index reports ``expected`` (KV events are published after the
        step, and each router's mirror reads them from the event log)."""
        deadline = time.monotonic() + timeout_s
        got = None
        for router in range(len(self.routers)):
            while time.monotonic() < deadline:
                got = await self.match(chain, router)
                if got == expected:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"router {router}: index match {got}, expected {expected}")

    async def generate(self, tokens: Sequence[int], router: int = 0, api_key: Optional[str] = None,
                       salt: str = "", max_tokens: int = 2) -> common_pb2.GenerateResponse:
        """One request through a router; returns its final message."""
        channel = grpc.aio.insecure_channel(self.routers[router].address)
        self._channels.append(channel)
        req = router_pb2.GenerateRequest(cache_salt=salt)
        req.token_ids.ids.extend(tokens)
        req.sampling.max_tokens = max_tokens
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        last = None
        async for msg in router_pb2_grpc.RouterStub(channel).Generate(req, metadata=metadata):
            last = msg
        return last

    async def direct(self, rid: str, tokens: Sequence[int], scope: str = "default",
                     salt: str = "") -> common_pb2.GenerateResponse:
        """One request straight to a replica (bypassing routing), e.g. to warm its cache."""
        channel = grpc.aio.insecure_channel(self.replicas[rid].address)
        self._channels.append(channel)
        req = worker_pb2.WorkerGenerateRequest(request_id=f"direct-{time.monotonic_ns()}",
                                               prompt_token_ids=tokens, cache_scope=scope,
                                               cache_salt=salt)
        req.sampling.max_tokens = 1
        last = None
        async for msg in worker_pb2_grpc.WorkerStub(channel).Generate(req):
            last = msg
        return last

    async def stop(self) -> None:
        for c in self._channels:
            await c.close()
        for r in self.routers:
            await r.stop(grace_s=0.1)
        for s in self.replicas.values():
            await s.stop(grace_s=0.1)
        self.routers, self.replicas, self._channels = [], {}, []


@contextlib.asynccontextmanager
async def running_fleet(redis_url: str, namespace: str, model_dir: str):
    """An empty :class:`Fleet` serving ``model_dir``, stopped on exit."""
    f = Fleet(redis_url, namespace, model_dir)
    try:
        yield f
    finally:
        await f.stop()


def prompt(seed: int, n_tokens: int) -> list[int]:
    """Deterministic plain-token ids (no special tokens)."""
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n_tokens)]
