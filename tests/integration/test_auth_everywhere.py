"""Every RPC of the router's gRPC port and every HTTP route is authenticated in one place
(issue 24 item 8); ClusterStatus is for the key file's admins; health stays open."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.v1 import router_pb2, router_pb2_grpc


@pytest.fixture
async def keyed_router(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"key-acme": "acme", "key-root": "root"},
                                "admins": ["root"]}))
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(http_port=0, api_keys_file=str(keys))
    await fleet.wait_replicas(1)
    return router


def _md(key: str):
    return (("authorization", f"Bearer {key}"),)


async def test_every_router_rpc_needs_a_key_and_cluster_status_an_admin(keyed_router):
    async with grpc.aio.insecure_channel(keyed_router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        calls = {
            "Tokenize": lambda md: stub.Tokenize(router_pb2.TokenizeRequest(text="hi"), metadata=md),
            "ListModels": lambda md: stub.ListModels(router_pb2.ListModelsRequest(), metadata=md),
            "ClusterStatus": lambda md: stub.ClusterStatus(router_pb2.ClusterStatusRequest(),
                                                           metadata=md),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(None)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(_md("wrong"))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert (await calls["Tokenize"](_md("key-acme"))).token_ids
        assert (await calls["ListModels"](_md("key-acme"))).models[0].name == "tiny-llama"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await calls["ClusterStatus"](_md("key-acme"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admins" in err.value.details()
        status = await calls["ClusterStatus"](_md("key-root"))
        assert [r.replica_id for r in status.replicas] == ["rep-a"]
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # open: a probe


async def test_every_http_route_needs_a_key_but_health(keyed_router):
    async with httpx.AsyncClient(base_url=f"http://{keyed_router.http_address}") as client:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/no-such-route")):
            resp = await client.request(method, path, json={"prompt": "hi"})
            assert resp.status_code == 401, (method, path)
            assert resp.json()["error"]["type"] == "authentication_error"
        assert (await client.get("/health")).status_code == 200
        ok = await client.get("/v1/models", headers={"authorization": "Bearer key-acme"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny-llama"
