"""Adapter listings show a tenant only the adapters it may use (issue 24 item 8), on both
edges: gRPC ListModels and HTTP /v1/models."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from starlette.testclient import TestClient

from kvfleet import grpc_auth
from kvfleet.index_keys import ReplicaInfo
from kvfleet.router.auth import Authenticator
from kvfleet.router.http_front import HttpFront
from kvfleet.router.server import RouterService

KEYS = {"key-acme": "acme", "key-globex": "globex"}


def _core():
    auth = Authenticator(KEYS, adapter_tenants={"sql": ["acme"]})
    info = ReplicaInfo("rep-a", "127.0.0.1:1", "tiny", 1, 16,
                       adapters=(("chat", "r1"), ("sql", "r2")))
    model = SimpleNamespace(name="tiny", max_context=256, block_size=16,
                            identity=SimpleNamespace(digest=lambda: b"\0" * 16))
    return SimpleNamespace(auth=auth, authenticate=auth.tenant, models={"tiny": model},
                           default_model="tiny",
                           replicas=SimpleNamespace(for_model=lambda name: [(info, None)]))


def test_grpc_list_models_hides_adapters_limited_to_other_tenants() -> None:
    service = RouterService(_core())

    async def names(tenant: str) -> list[str]:
        grpc_auth._CALLER.set(tenant)  # what the interceptor sets for an authorised call
        out = await service.ListModels(None, None)
        return [a.name for a in out.models[0].adapters]

    assert asyncio.run(names("acme")) == ["chat", "sql"]
    assert asyncio.run(names("globex")) == ["chat"]


def test_http_models_hides_adapters_limited_to_other_tenants() -> None:
    client = TestClient(HttpFront(_core()).app)

    def ids(key: str) -> list[str]:
        resp = client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert resp.status_code == 200
        return [m["id"] for m in resp.json()["data"]]

    assert ids("key-acme") == ["tiny", "chat", "sql"]
    assert ids("key-globex") == ["tiny", "chat"]
    assert client.get("/v1/models").status_code == 401


def test_http_unknown_route_and_method_answer_openai_error_bodies() -> None:
    client = TestClient(HttpFront(_core()).app)
    auth = {"authorization": "Bearer key-acme"}
    resp = client.get("/v1/chat/completions", headers=auth)
    assert resp.status_code == 405 and "POST" in resp.headers["allow"]
    assert resp.json()["error"]["code"] == "method_not_allowed"
    resp = client.post("/v1/nothing", headers=auth, json={})
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": "no route POST /v1/nothing", "type": "not_found_error",
                                    "param": None, "code": "not_found"}
