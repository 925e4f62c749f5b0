"""Overload: a request the fleet cannot take is refused (RESOURCE_EXHAUSTED with a retry hint),
never cancelled; every admitted request completes and the KV pools return to idle."""

from __future__ import annotations

import asyncio
import collections

import grpc

from kvfleet.grpc_util import SERVER_OPTIONS
from kvfleet.router.capacity import RETRY_PUSHBACK_KEY
from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel
from tests.integration.routing_fleet import prompt
from tests.integration.test_worker_stream import idle

SLOW = CostModel(0.05, 0.0, 0.0, "test: 50 ms per step")
TIGHT = SchedulerConfig(max_num_seqs=2, max_waiting=4, max_num_batched_tokens=256)  # 6 in all
MAX_TOKENS = 20


async def _outcome(call) -> tuple[str, str, dict, int]:
    """(status name, details, trailers, tokens) of one streaming call, never raising."""
    tokens = 0
    try:
        async for msg in call:
            tokens += len(msg.token_ids)
        return "OK", "", {}, tokens
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details(), dict(exc.trailing_metadata() or ()), tokens


def _request(seed: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest()
    req.token_ids.ids.extend(prompt(seed, 40))
    req.sampling.max_tokens = MAX_TOKENS
    req.sampling.ignore_eos = True
    return req


async def test_ten_times_capacity_through_the_router_is_refused_never_cancelled(fleet):
    servers = [await fleet.add_replica(rid, cost_model=SLOW, scheduler=TIGHT)
               for rid in ("rep-a", "rep-b")]
    router = await fleet.add_router()
    await fleet.wait_replicas(2)
    assert {i.max_requests for i, _ in router.replicas.replicas.values()} == {6}
    capacity = 2 * TIGHT.max_sequences
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        outs = await asyncio.gather(*(_outcome(stub.Generate(_request(i)))
                                      for i in range(10 * capacity)))
    codes = collections.Counter(code for code, *_ in outs)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["OK"] >= capacity  # the first `capacity` fit at once
    assert all(tokens == MAX_TOKENS for code, _, _, tokens in outs if code == "OK")
    refused = [(details, trailers) for code, details, trailers, _ in outs if code != "OK"]
    assert all(trailers.get(RETRY_PUSHBACK_KEY) == "1000" for _, trailers in refused)
    assert all("limit of 6 running + waiting sequences" in d for d, _ in refused)
    assert any(d.startswith("every replica of model") for d, _ in refused)  # router-side
    for server in servers:
        assert server.service.reservations.count == 0
        stats = await idle(server)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert server.engine.kv.check_invariants() is None
    assert sum(router.replicas.ledger.inflight.values()) == 0


async def test_a_replica_refuses_on_arrival_past_its_limit(fleet):
    server = await fleet.add_replica("rep-a", cost_model=SLOW, scheduler=TIGHT)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)

        def call(i: int):
            req = worker_pb2.WorkerGenerateRequest(request_id=f"direct-{i}", tenant="default",
                                                   prompt_token_ids=prompt(i, 40))
            req.sampling.max_tokens, req.sampling.ignore_eos = MAX_TOKENS, True
            return stub.Generate(req)

        outs = await asyncio.gather(*(_outcome(call(i)) for i in range(40)))
    codes = collections.Counter(code for code, *_ in outs)
    assert codes == {"OK": 6, "RESOURCE_EXHAUSTED": 34}  # the arrival count is exact
    assert all("replica is at its limit of 6" in d for c, d, _, _ in outs if c != "OK")
    stats = await idle(server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert server.service.reservations.count == 0


DEEP = SchedulerConfig(max_num_seqs=2, max_waiting=30, max_num_batched_tokens=256)  # 32 in all


async def test_a_burst_queued_past_the_routers_idle_bound_is_kept_alive_or_refused_at_once(fleet):
    # Queued requests were killed as INTERNAL ("sent no frame for this call") once they had
    # waited the router's idle bound. A waiting request is alive (liveness frames), and the
    # replica admits only the waiting work it can start within its queue bound.
    server = await fleet.add_replica("rep-a", cost_model=SLOW, scheduler=DEEP,
                                     max_queue_wait_s=6.0)
    router = await fleet.add_router(call_idle_s=3.0)
    await fleet.wait_replicas(1)
    (info, _), = router.replicas.replicas.values()
    assert info.max_queue_wait_s == 6.0  # advertised
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        outs = await asyncio.gather(*(_outcome(stub.Generate(_request(i))) for i in range(30)))
    codes = collections.Counter(code for code, *_ in outs)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, [o[:2] for o in outs if o[0] not in
                                                          ("OK", "RESOURCE_EXHAUSTED")]
    # Two seats and about 6 s of queue (0.5 s of work ahead per waiting request) held.
    assert DEEP.max_num_seqs < codes["OK"] < 30 and codes["RESOURCE_EXHAUSTED"]
    assert all(tokens == MAX_TOKENS for code, _, _, tokens in outs if code == "OK")
    assert all("queue bound of 6 s" in d for c, d, _, _ in outs if c != "OK")
    assert server.service.reservations.count == 0 and server.service.wait_bound.sequences == 0
    stats = await idle(server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


class _Sleepy(router_pb2_grpc.RouterServicer):
    async def Generate(self, request, context):
        await asyncio.sleep(0.2)
        yield common_pb2.GenerateResponse(token_ids=[1])


async def test_a_burst_past_grpc_cores_default_pending_limit_is_not_cancelled():
    # gRPC core cancels calls the Python server has not picked up once more than 1,000 wait
    # (its default): the spurious CANCELLED of issue 17. SERVER_OPTIONS raises that bound.
    server = grpc.aio.server(options=SERVER_OPTIONS)
    router_pb2_grpc.add_RouterServicer_to_server(_Sleepy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            outs = await asyncio.gather(*(_outcome(stub.Generate(_request(i)))
                                          for i in range(1500)))
    finally:
        await server.stop(0)
    assert collections.Counter(code for code, *_ in outs) == {"OK": 1500}
