"""Issue 24 item 16: runtime adapter loads and unloads survive replacement — recorded in
Redis, applied by every replica that starts later. Load at run time → a new replica (scale
1 → 2) serves it; unload → a replacement no longer does (nor a start-time adapter unloaded)."""

from __future__ import annotations

import grpc
import pytest

from kvfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.replica.replica import ReplicaConfig, ReplicaServer


def _config(rid: str, model_dir, adapters, redis_url: str, namespace: str) -> ReplicaConfig:
    root = adapters["qv"].parent
    return ReplicaConfig(replica_id=rid, model_name="tiny", model_dir=str(model_dir), block_size=16,
                         num_blocks=32, one_row_weights=False, redis_url=redis_url,
                         namespace=namespace, heartbeat_interval_s=0.2, max_loras=2,
                         max_lora_rank=16, adapters=(("qv", str(adapters["qv"])),),
                         adapter_roots=(str(root),),
                         scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))


async def _generate(server: ReplicaServer, adapter: str) -> list[int]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        req = worker_pb2.WorkerGenerateRequest(request_id=f"{server.cfg.replica_id}-{adapter}",
                                               prompt_token_ids=list(range(5, 25)),
                                               tenant="default", adapter=adapter)
        req.sampling.max_tokens = 2
        req.sampling.ignore_eos = True
        return [t async for m in worker_pb2_grpc.WorkerStub(channel).Generate(req) for t in m.token_ids]


async def _admin(server: ReplicaServer, op: str, name: str, path: str = "") -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        if op == "load":
            await stub.LoadAdapter(common_pb2.LoadAdapterRequest(name=name, path=path))
        else:
            await stub.UnloadAdapter(common_pb2.UnloadAdapterRequest(name=name))


async def test_runtime_adapter_changes_reach_replicas_started_later(
        tiny_llama_dir, tiny_adapters, redis_server, redis_namespace) -> None:
    cfg = lambda rid: _config(rid, tiny_llama_dir, tiny_adapters, redis_server.url, redis_namespace)  # noqa: E731
    first = ReplicaServer(cfg("a"))
    started = [first]
    try:
        await first.start()
        await _admin(first, "load", "rs", str(tiny_adapters["rs"]))
        revision = first.engine.adapters.spec("rs").revision

        second = ReplicaServer(cfg("b"))  # a scale-up: started with the same config
        started.append(second)
        await second.start()
        assert second.engine.adapters.spec("rs").revision == revision
        assert len(await _generate(second, "rs")) == 2

        for server in (first, second):  # as the router applies an unload: on every replica
            await _admin(server, "unload", "rs")
            await _admin(server, "unload", "qv")  # a start-time adapter
        third = ReplicaServer(cfg("c"))  # a replacement
        started.append(third)
        await third.start()
        assert set(third.engine.adapters.catalog) == set()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(third, "rs")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "rs" in err.value.details()
        assert third.adapter_fields()["adapters"] == ()
    finally:
        for server in started:
            await server.stop()
