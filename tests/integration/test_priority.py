"""Priority classes through a real router and worker: a key's class travels to the
scheduler and bounds what its requests may ask for, an interactive request preempts a streaming batch one and
finishes first, the batch one still finishes whole, and a second batch request is refused
with its class named while the fleet keeps headroom for higher classes."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import grpc
import httpx

from kvfleet.v1 import router_pb2, router_pb2_grpc
from tests.integration.routing_fleet import prompt
from tests.integration.test_overload import SLOW, TIGHT, _outcome
from tests.integration.test_worker_stream import idle

ONE_SEAT = replace(TIGHT, max_num_seqs=1)  # 1 running + 4 waiting


def _request(seed: int, max_tokens: int, **priority) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(**priority)
    req.token_ids.ids.extend(prompt(seed, 24))
    req.sampling.max_tokens, req.sampling.ignore_eos = max_tokens, True
    return req


async def test_interactive_preempts_streaming_batch_and_batch_is_refused_first(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"k-night": {"tenant": "acme", "priority": "batch"},
                                         "k-chat": {"tenant": "acme", "priority": "interactive"}}}))
    server = await fleet.add_replica("rep-a", cost_model=SLOW, scheduler=ONE_SEAT)
    # Fleet capacity 5 sequences; batch is admitted up to 20 %: one batch request at a time.
    router = await fleet.add_router(api_keys_file=str(keys),
                                    priority_admit={"interactive": 1.0, "default": 1.0,
                                                    "batch": 0.2})
    await fleet.wait_replicas(1)
    md = (("authorization", "Bearer k-night"),)
    finished: list[str] = []
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        batch_call = stub.Generate(_request(1, 30), metadata=md)  # the key's default: batch
        first = await batch_call.read()  # it runs and has streamed a token
        assert first.token_ids

        async def rest_of_batch() -> tuple[str, int]:
            tokens = 0
            while (msg := await batch_call.read()) is not grpc.aio.EOF:
                tokens += len(msg.token_ids)
            finished.append("batch")
            return (await batch_call.code()).name, tokens

        batch_task = asyncio.create_task(rest_of_batch())
        refused = await _outcome(stub.Generate(_request(2, 5), metadata=md))
        assert refused[0] == "RESOURCE_EXHAUSTED" and "batch requests" in refused[1]
        chat = await _outcome(stub.Generate(_request(3, 3),  # the key's class: interactive
                                            metadata=(("authorization", "Bearer k-chat"),)))
        finished.append("interactive")
        code, tokens = await batch_task
    assert chat[0] == "OK" and chat[3] == 3
    assert code == "OK" and tokens + len(first.token_ids) == 30  # recomputed, nothing lost
    assert finished == ["interactive", "batch"]
    stats = await idle(server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_a_key_class_is_a_ceiling_over_grpc_and_http(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"k-night": {"tenant": "acme", "priority": "batch"},
                                         "k-plain": "globex"}}))
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(api_keys_file=str(keys), http_port=0)
    await fleet.wait_replicas(1)
    night, plain = (("authorization", "Bearer k-night"),), (("authorization", "Bearer k-plain"),)
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for key, ask in ((night, {"priority_level": -1000}), (night, {"priority_class": "default"}),
                         (plain, {"priority_class": "interactive"})):
            code, details, *_ = await _outcome(stub.Generate(_request(1, 2, **ask), metadata=key))
            field = next(iter(ask))
            assert code == "PERMISSION_DENIED" and details.startswith(f"{field}:"), (ask, details)
        # Lowering is allowed: a plain key (class default) may ask for batch or a number past it.
        for key, ask in ((plain, {"priority_class": "batch"}), (night, {"priority_level": 7}),
                         (plain, {})):
            assert (await _outcome(stub.Generate(_request(2, 2, **ask), metadata=key)))[0] == "OK"
    body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 2, "priority": "interactive"}
    async with httpx.AsyncClient(base_url=f"http://{router.http_address}", timeout=30) as client:
        refused = await client.post("/v1/completions", json=body,
                                    headers={"authorization": "Bearer k-night"})
        assert refused.status_code == 403 and "priority" in refused.json()["error"]["message"]
        ok = await client.post("/v1/completions", json={**body, "priority": "batch"},
                               headers={"authorization": "Bearer k-night"})
        assert ok.status_code == 200, ok.text
