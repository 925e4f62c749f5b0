"""The whole path with real components: router process → Redis index → Ray-actor replicas.

Serves the tiny seeded Llama (SmolLM2's tokenizer and chat template) so the suite stays fast;
tests/e2e covers the real SmolLM2 model through the CLI.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kvfleet.client import Client, build_request
from kvfleet.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from tests.fixtures.cluster import wait_indexed

# Two system prompts that share their first block (like a chat template's default system
# text) but differ after it: first-block routing cannot tell them apart, prefix routing can.
COMMON = ("Follow the house rules below carefully, in order, and keep every answer short, "
          "polite and factual. ")
SYSTEM_A = COMMON + ("Rule one for the astronomy desk: talk about planets, moons, comets and "
                     "stars, give distances in kilometres, and cite the mission that measured it.")
SYSTEM_B = COMMON + ("Rule one for the bakery desk: talk about bread, flour, yeast and ovens, "
                     "give weights in grams, and say how long the dough should rest at room temperature.")


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def worker_stub(address: str):
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))


def replicas(client: Client) -> dict[str, str]:
    """replica_id → address, once both replicas are registered."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = client.cluster_status()
        if len(status.replicas) == 2:
            return {r.replica_id: r.address for r in status.replicas}
        time.sleep(0.2)
    raise AssertionError("replicas did not register")


def idle_free_blocks(address: str, timeout_s: float = 20.0) -> worker_pb2.StatsResponse:
    """Stats once the replica has nothing running or waiting."""
    stub = worker_stub(address)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = stub.Stats(worker_pb2.StatsRequest())
        if s.running == 0 and s.waiting == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"replica {address} never became idle")


def router_sees_idle(client: Client, since: float, timeout_s: float = 20.0) -> None:
    """Wait until the router's view holds, for every replica, a load report taken after
    ``since`` (``time.monotonic()``) that shows nothing running or waiting: requests sent to a
    worker directly count in its reports until the next heartbeat, and a replica reported
    busy may rightly lose a request to an idle one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        elapsed = time.monotonic() - since
        status = client.cluster_status()
        if status.replicas and all(r.running == 0 and r.waiting == 0 and r.heartbeat_age_s < elapsed
                                   for r in status.replicas):
            return
        time.sleep(0.05)
    raise AssertionError("the router never saw every replica idle")


def tokens_of(client: Client, messages) -> list[int]:
    stub = client._stub
    req = router_pb2.TokenizeRequest()
    for m in messages:
        req.messages.messages.add(role=m["role"], content=m["content"])
    return list(stub.Tokenize(req).token_ids)


@pytest.fixture
def client(tiny_cluster):
    with Client(tiny_cluster.router_address) as c:
        yield c


def test_stream_returns_tokens_text_usage_and_timing(client):
    chunks = list(client.stream(messages=chat(SYSTEM_A, "hello"), max_tokens=12, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 12
    last = chunks[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 12
    assert last.prompt_tokens > 32 and last.replica_id
    assert last.timing["ttft_s"] > 0 and last.timing["decode_s"] >= 0
    assert last.timing["replica_s"] > 0  # the worker's forward seconds, relayed unchanged
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_request_lands_on_the_replica_holding_its_longest_prefix(client, tiny_cluster):
    ids = replicas(client)
    (rid_x, addr_x), (rid_y, addr_y) = sorted(ids.items())
    prompt_a = tokens_of(client, chat(SYSTEM_A, "Which planet is largest?"))
    prompt_b = tokens_of(client, chat(SYSTEM_B, "Which flour is best?"))
    assert prompt_a[:16] == prompt_b[:16], "the two prompts must share their first block"
    shared_a = len(tokens_of(client, chat(SYSTEM_A, "x"))) // 16  # full blocks of the prefix
    # Warm A's prefix on X and B's on Y directly (bypassing the router), in both assignments
    # the router must follow the holder, whatever the first block alone would suggest.
    for salt, (a_addr, a_id, b_addr, b_id) in {
        "s1": (addr_x, rid_x, addr_y, rid_y), "s2": (addr_y, rid_y, addr_x, rid_x),
    }.items():
        for addr, prompt in ((a_addr, prompt_a), (b_addr, prompt_b)):
            req = worker_pb2.WorkerGenerateRequest(request_id=f"warm-{salt}-{addr}",
                                                   prompt_token_ids=prompt, tenant="default",
                                                   cache_salt=salt)
            req.sampling.max_tokens = 1
            list(worker_stub(addr).Generate(req))
        warmed = time.monotonic()
        for holder, prompt in ((a_id, prompt_a), (b_id, prompt_b)):
            wait_indexed(tiny_cluster, client, holder, token_ids=prompt, cache_salt=salt)
        router_sees_idle(client, since=warmed)
        out_a = list(client.stream(messages=chat(SYSTEM_A, "Which moon is largest?"),
                                   cache_salt=salt, max_tokens=2))[-1]
        out_b = list(client.stream(messages=chat(SYSTEM_B, "How long should dough rest?"),
                                   cache_salt=salt, max_tokens=2))[-1]
        assert out_a.replica_id == a_id and out_b.replica_id == b_id
        assert out_a.cached_prompt_tokens >= (shared_a - 1) * 16 > 16
        assert out_b.cached_prompt_tokens > 16


def test_other_tenant_salt_never_hits(client, tiny_cluster):
    msgs = chat(SYSTEM_A, "Name a comet.")
    first = list(client.stream(messages=msgs, max_tokens=1, cache_salt="tenant-test"))[-1]
    wait_indexed(tiny_cluster, client, first.replica_id, messages=msgs, cache_salt="tenant-test")
    again = list(client.stream(messages=msgs, max_tokens=1, cache_salt="tenant-test"))[-1]
    other = list(client.stream(messages=msgs, max_tokens=1, cache_salt="another-salt"))[-1]
    assert again.cached_prompt_tokens > 0
    assert other.cached_prompt_tokens == 0


@pytest.mark.parametrize("kwargs, code, field", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    (dict(messages=[]), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", max_tokens=10_000), grpc.StatusCode.OUT_OF_RANGE, "max_tokens"),
    (dict(prompt="hi", model="no-such-model"), grpc.StatusCode.NOT_FOUND, "no-such-model"),
    (dict(token_ids=[1, 10**9]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (dict(token_ids=[5] * 300), grpc.StatusCode.OUT_OF_RANGE, "token_ids"),  # context 256
    (dict(messages=[{"role": "wizard", "content": "hi"}]), grpc.StatusCode.INVALID_ARGUMENT, "role"),
    (dict(prompt="hi", stop_token_ids=[10**9]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
])
def test_bad_input_gets_a_clear_status_and_leaks_nothing(client, tiny_cluster, kwargs, code, field):
    before = {a: idle_free_blocks(a).num_free_blocks for a in tiny_cluster.replica_addresses}
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(**kwargs))
    assert err.value.code() == code
    assert field in err.value.details()
    after = {a: idle_free_blocks(a).num_free_blocks for a in tiny_cluster.replica_addresses}
    assert after == before


def test_client_names_a_field_its_value_cannot_fit():
    """A negative seed cannot be encoded (uint64): a clear error before anything is sent."""
    with pytest.raises(ValueError, match="sampling.seed"):
        build_request("hi", seed=-5)
    with pytest.raises(ValueError, match="sampling.stop_token_ids"):
        build_request("hi", stop_token_ids=[2**40])  # beyond int32


def test_worker_rejects_out_of_vocabulary_stop_token_directly(tiny_cluster):
    stub = worker_stub(tiny_cluster.replica_addresses[0])
    req = worker_pb2.WorkerGenerateRequest(request_id="bad-stop", prompt_token_ids=[5, 6, 7])
    req.sampling.max_tokens = 4
    req.sampling.stop_token_ids.append(10**6)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids" in err.value.details()


def test_worker_rejects_out_of_context_prompt_directly(tiny_cluster):
    stub = worker_stub(tiny_cluster.replica_addresses[0])
    req = worker_pb2.WorkerGenerateRequest(request_id="too-long", prompt_token_ids=[5] * 250)
    req.sampling.max_tokens = 10
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_client_cancellation_cancels_the_worker_stream_and_frees_blocks(client, tiny_cluster):
    stream = client.stream(messages=chat(SYSTEM_B, "Tell me a long story."), max_tokens=150,
                           ignore_eos=True)
    got = [next(stream), next(stream)]
    assert got[0].token_ids
    stream.close()  # client goes away mid-stream
    for addr in tiny_cluster.replica_addresses:
        s = idle_free_blocks(addr)
        # Idle: every block is free (cached blocks are evictable, hence free).
        assert s.num_free_blocks == s.num_total_blocks


def test_deadline_exceeded(client):
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("Count to a thousand.", max_tokens=240, ignore_eos=True, timeout=0.05))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_health_and_reflection_are_served(tiny_cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for addr in [tiny_cluster.router_address, *tiny_cluster.replica_addresses]:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
        resp = stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_cluster_status_names_lifecycle_routers_and_redis(tiny_cluster, redis_server) -> None:
    from kvfleet.index_keys import redis_host

    with Client(tiny_cluster.router_address) as client:
        replicas(client)
        prompt = "Status check: " * 8
        client.generate(prompt, max_tokens=2)
        client.generate(prompt, max_tokens=2)  # the second hits the first's blocks
        deadline = time.monotonic() + 10  # the hit rate rides on the next heartbeat (1 s)
        while time.monotonic() < deadline:
            status = client.cluster_status()
            if any(r.lifecycle.prefix_hit_rate > 0 for r in status.replicas):
                break
            time.sleep(0.2)
    hosts = {r["replica_id"] for r in tiny_cluster.serve_replicas()}
    assert {r.lifecycle.state for r in status.replicas} == {"serving"}
    assert {r.lifecycle.serve_replica for r in status.replicas} == hosts
    assert any(0 < r.lifecycle.prefix_hit_rate <= 1 for r in status.replicas)
    assert [r.address for r in status.routers] == [tiny_cluster.router_address]
    assert status.routers[0].policy == "predicted_ttft" and status.routers[0].pid > 0
    assert status.redis == redis_host(redis_server.url)
