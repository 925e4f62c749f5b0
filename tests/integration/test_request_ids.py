"""Unique live request ids: per tenant on a router (namespaced before they reach a worker),
and on each worker for direct clients."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvfleet.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvfleet.worker.executor.cost_model import CostModel
from tests.integration.routing_fleet import prompt

SLOW = CostModel(0.02, 0.0, 0.0, "test: 20 ms per step")


def _request(request_id: str, seed: int, max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(request_id=request_id)
    req.token_ids.ids.extend(prompt(seed, 40))
    req.sampling.max_tokens, req.sampling.ignore_eos = max_tokens, True
    return req


async def _last(call):
    """The call's last message, by ``read()`` (it also serves a call already read from);
    raises the call's non-OK status."""
    last = None
    while (msg := await call.read()) is not grpc.aio.EOF:
        last = msg
    return last


async def test_a_live_id_is_refused_for_its_tenant_and_free_for_another(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-acme": "acme", "key-globex": "globex"}))
    await fleet.add_replica("rep-a", cost_model=SLOW)
    router = await fleet.add_router(api_keys_file=str(keys))
    await fleet.wait_replicas(1)
    acme, globex = (("authorization", "Bearer key-acme"),), (("authorization", "Bearer key-globex"),)
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        long = stub.Generate(_request("req-1", 1, 100), metadata=acme)
        first = await long.read()  # running now
        assert first.request_id == "req-1"  # the client's id, not the worker's namespaced one
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _last(stub.Generate(_request("req-1", 2, 2), metadata=acme))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "request_id 'req-1'" in err.value.details()
        other = await _last(stub.Generate(_request("req-1", 3, 2), metadata=globex))
        assert other.request_id == "req-1" and other.usage.completion_tokens == 2
        rest = await _last(long)
        assert rest.usage.completion_tokens == 100
        again = await _last(stub.Generate(_request("req-1", 4, 2), metadata=acme))
        assert again.usage.completion_tokens == 2  # finished ids are free again
    assert router.core._live_ids == set()


async def test_a_worker_refuses_a_duplicate_live_id_from_a_direct_client(fleet):
    server = await fleet.add_replica("rep-a", cost_model=SLOW)

    def req(max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
        r = worker_pb2.WorkerGenerateRequest(request_id="acme/req-1", tenant="acme",
                                             prompt_token_ids=prompt(5, 40))
        r.sampling.max_tokens, r.sampling.ignore_eos = max_tokens, True
        return r

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        long = stub.Generate(req(60))
        await long.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _last(stub.Generate(req(2)))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert (await _last(long)).usage.completion_tokens == 60
        await asyncio.sleep(0)
        assert server.service.reservations.count == 0
