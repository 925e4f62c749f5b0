"""What one request may ask the router to tokenize is bounded, and tokenizing runs off the
event loop (issue 24 item 9)."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest

from kvfleet.router.core import PromptLimits
from kvfleet.router.served_model import ServedModel
from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc

LIMITS = PromptLimits(max_prompt_bytes=1000, max_messages=3, max_prompts=2)


@pytest.fixture
async def router(fleet):
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(http_port=0, prompt_limits=LIMITS)
    await fleet.wait_replicas(1)
    return router


def _messages(n: int, content: str = "hi") -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=content)
                                         for _ in range(n)])


async def test_each_cap_is_refused_naming_its_limit_on_both_edges(router):
    big = "x" * 1001
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        refused = {
            "Generate text": stub.Generate(router_pb2.GenerateRequest(text=big)),
            "Generate messages": stub.Generate(router_pb2.GenerateRequest(messages=_messages(4))),
            "Generate content": stub.Generate(router_pb2.GenerateRequest(
                messages=_messages(2, "y" * 600))),
            "Tokenize text": stub.Tokenize(router_pb2.TokenizeRequest(text=big)),
            "Tokenize messages": stub.Tokenize(router_pb2.TokenizeRequest(messages=_messages(4))),
        }
        for what, call in refused.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if what.startswith("Generate"):
                    async for _ in call:
                        pass
                else:
                    await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert ("--max-prompt-bytes" in err.value.details()
                    or "--max-messages" in err.value.details()), (what, err.value.details())
        ok = await stub.Tokenize(router_pb2.TokenizeRequest(messages=_messages(3)))
        assert ok.token_ids
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}/v1") as client:
        resp = await client.post("/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1})
        assert resp.status_code == 413 and "--max-prompts-per-request" in resp.text
        resp = await client.post("/completions", json={"prompt": big, "max_tokens": 1})
        assert resp.status_code == 413 and "--max-prompt-bytes" in resp.text
        resp = await client.post("/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 2


async def test_tokenizing_and_templating_run_off_the_event_loop(router, monkeypatch):
    threads: list[str] = []
    for name in ("encode_text", "encode_messages"):
        original = getattr(ServedModel, name)

        def spy(self, prompt, _original=original):
            threads.append(threading.current_thread().name)
            return _original(self, prompt)

        monkeypatch.setattr(ServedModel, name, spy)
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await stub.Tokenize(router_pb2.TokenizeRequest(text="hello"))
        req = router_pb2.GenerateRequest(messages=_messages(1))
        req.sampling.max_tokens = 1
        async for _ in stub.Generate(req):
            pass
    assert len(threads) == 2
    assert all(t.startswith("kvfleet-tokenize") for t in threads), threads
