"""``Worker.GenerateStream``: routed calls multiplexed on one stream, against real replicas
(cost-model forward, real scheduler and block pool) and a real router."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.executor.cost_model import CostModel
from tests.integration.routing_fleet import BLOCK, prompt

SLOW = CostModel(0.005, 0.0, 0.0, "test: 5 ms per step")  # slow enough to act mid-call


def generate_frame(call_id: int, tokens, max_tokens: int = 3, **sampling) -> worker_pb2.GenerateStreamRequest:
    frame = worker_pb2.GenerateStreamRequest(call_id=call_id)
    frame.generate.request_id = f"call-{call_id}"
    frame.generate.prompt_token_ids.extend(tokens)
    frame.generate.tenant = "default"
    frame.generate.sampling.max_tokens = max_tokens
    frame.generate.sampling.ignore_eos = True
    for key, value in sampling.items():
        field = getattr(frame.generate.sampling, key)
        field.extend(value) if isinstance(value, list) else setattr(frame.generate.sampling, key, value)
    return frame


async def collect(call, calls) -> dict[int, list]:
    """Frames per call id until each call in ``calls`` sent its done frame (or, for a dict,
    that many done frames)."""
    left = dict(calls) if isinstance(calls, dict) else {c: 1 for c in calls}
    got: dict[int, list] = {c: [] for c in left}
    while any(left.values()):
        for frame in await next_frames(call):
            got[frame.call_id].append(frame)
            left[frame.call_id] -= frame.done
    return got


async def next_frames(call) -> list:
    """The frames of the stream's next batch message."""
    batch = await asyncio.wait_for(call.read(), 10)
    assert batch is not grpc.aio.EOF and batch.frames
    return list(batch.frames)


async def idle(server, timeout_s: float = 10.0) -> dict:
    """The replica's stats once nothing runs or waits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = server._loop.stats
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"replica still busy: {server._loop.stats}")


async def test_calls_interleave_on_one_stream_and_match_plain_generate(fleet):
    server = await fleet.add_replica("rep-a")
    channel = grpc.aio.insecure_channel(server.address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        call = stub.GenerateStream()
        prompts = {c: prompt(c, 2 * BLOCK + c) for c in (1, 2, 3)}
        for c, tokens in prompts.items():
            await call.write(generate_frame(c, tokens, max_tokens=4))
        got = await collect(call, set(prompts))
        for c, frames in got.items():
            assert all(f.call_id == c for f in frames)
            done = frames[-1]
            assert done.done and done.status_code == 0 and done.worker_duration_s > 0
            assert [f.done for f in frames] == [False] * (len(frames) - 1) + [True]
            messages = [f.message for f in frames if f.HasField("message")]
            # The same request through Worker.Generate streams the same messages.
            plain = [m async for m in stub.Generate(generate_frame(c, prompts[c], 4).generate)]
            assert [list(m.token_ids) for m in messages] == [list(m.token_ids) for m in plain]
            assert messages[-1].finish_reason == plain[-1].finish_reason != 0
            assert messages[-1].usage.prompt_tokens == len(prompts[c])
            assert sum(len(m.token_ids) for m in messages) == 4
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # half-closed, nothing open: the stream ends
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()


async def test_a_refused_call_ends_with_its_status_and_the_stream_lives_on(fleet):
    server = await fleet.add_replica("rep-a", cost_model=SLOW)
    channel = grpc.aio.insecure_channel(server.address)
    try:
        call = worker_pb2_grpc.WorkerStub(channel).GenerateStream()
        await call.write(generate_frame(1, prompt(1, 20), stop_token_ids=[10**6]))
        await call.write(generate_frame(2, prompt(2, 20), max_tokens=30))
        await call.write(generate_frame(2, prompt(3, 20)))  # call 2 is still open
        await call.write(generate_frame(3, [5] * 2000))  # beyond the replica's context
        got = await collect(call, {1: 1, 2: 2, 3: 1})
        refused = got[1][-1]
        assert refused.done and refused.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "stop_token_ids" in refused.status_message
        statuses = [f.status_code for f in got[2] if f.done]
        assert statuses[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # the duplicate id
        assert "already open" in [f for f in got[2] if f.done][0].status_message
        assert statuses[-1] == 0 and got[2][-1].message.usage.completion_tokens == 30
        assert got[3][-1].status_code == grpc.StatusCode.OUT_OF_RANGE.value[0]
        await call.write(worker_pb2.GenerateStreamRequest(call_id=5))  # no action
        await call.write(worker_pb2.GenerateStreamRequest(call_id=99, cancel=True))  # unknown
        empty = (await collect(call, {5}))[5][-1]
        assert empty.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "action" in empty.status_message
        await call.write(generate_frame(4, prompt(4, 20)))  # the stream still serves
        assert (await collect(call, {4}))[4][-1].status_code == 0
        call.cancel()
    finally:
        await channel.close()


async def test_cancel_frames_and_a_closed_stream_abort_calls_and_free_blocks(fleet):
    server = await fleet.add_replica("rep-a", cost_model=SLOW)
    total = server._loop.stats["num_total_blocks"]
    channel = grpc.aio.insecure_channel(server.address)
    try:
        call = worker_pb2_grpc.WorkerStub(channel).GenerateStream()
        for c in (1, 2):
            await call.write(generate_frame(c, prompt(c, 3 * BLOCK), max_tokens=150))
        first = (await next_frames(call))[0]
        assert not first.done and first.message.token_ids
        await call.write(worker_pb2.GenerateStreamRequest(call_id=first.call_id, cancel=True))
        other = 3 - first.call_id
        while True:  # the other call keeps streaming; the cancelled one ends without more frames
            frames = await next_frames(call)
            assert not any(f.done for f in frames)
            if any(f.call_id == other for f in frames):
                break
        await asyncio.sleep(0.1)
        assert server._loop.stats["running"] == 1
        call.cancel()  # the router went away: every call still open on the stream is aborted
        s = await idle(server)
        assert s["num_free_blocks"] == total
        assert server.engine.kv.check_invariants() is None
    finally:
        await channel.close()


async def test_the_router_fails_open_calls_when_a_worker_goes_and_reconnects(fleet):
    old = await fleet.add_replica("rep-a", cost_model=SLOW)
    router = await fleet.add_router()
    await fleet.wait_replicas(1)
    assert (await fleet.generate(prompt(1, 40))).replica_id == "rep-a"

    async def long_request():
        return await fleet.generate(prompt(2, 40), max_tokens=200)

    task = asyncio.create_task(long_request())
    await asyncio.sleep(0.3)
    await old.stop(grace_s=0.1)  # the replica goes away mid-stream
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await task
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "stream to worker" in err.value.details()
    fleet.replicas.pop("rep-a")
    await fleet.add_replica("rep-a")  # a new process, a new address
    await fleet.wait_replicas(1)
    deadline = time.monotonic() + 10
    while router.replicas.replicas["rep-a"][0].address != fleet.replicas["rep-a"].address:
        assert time.monotonic() < deadline
        await router.replicas.refresh()
        await asyncio.sleep(0.05)
    out = await fleet.generate(prompt(3, 40))
    assert out.replica_id == "rep-a" and out.usage.completion_tokens == 2


async def test_requests_move_off_a_replica_that_died_before_its_heartbeat_expired(fleet):
    dead = await fleet.add_replica("rep-a")
    await fleet.add_replica("rep-b")
    router = await fleet.add_router()
    await fleet.wait_replicas(2)
    served = {(await fleet.generate(prompt(10 + i, 40))).replica_id for i in range(6)}
    assert served == {"rep-a", "rep-b"}  # both streams are open
    # rep-a crashes: nothing deregisters it, so the registry lists it until its heartbeat TTL.
    publisher, dead.publisher = dead.publisher, None
    await publisher.close()
    await dead.stop(grace_s=0.1)
    outs = await asyncio.gather(*(fleet.generate(prompt(20 + i, 40)) for i in range(10)))
    assert [o.replica_id for o in outs] == ["rep-b"] * 10  # none failed, none went to rep-a
    await router.replicas.refresh()
    assert "rep-a" in router.replicas.replicas  # still registered: routing went around it


async def test_a_request_reaches_a_replacement_when_every_known_replica_is_gone(fleet):
    """Two crashed replicas still listed, a replacement registered after the router's last
    registry read: the request moves past both dead ones to the replacement (the router used
    to alternate between the two dead ones until its dispatches ran out: UNAVAILABLE)."""
    dead = [await fleet.add_replica("rep-a"), await fleet.add_replica("rep-b")]
    router = await fleet.add_router()
    await fleet.wait_replicas(2)
    served = {(await fleet.generate(prompt(10 + i, 40))).replica_id for i in range(6)}
    assert served == {"rep-a", "rep-b"}  # both streams are open
    router.replicas.refresh_interval_s = 3600.0  # only the router's own reads from now on
    await asyncio.sleep(0.6)  # the refresh loop's current 0.5 s sleep ends
    for server in dead:  # crashed: nothing deregisters them
        publisher, server.publisher = server.publisher, None
        await publisher.close()
        await server.stop(grace_s=0.1)
    await fleet.add_replica("rep-c")
    assert "rep-c" not in router.replicas.replicas
    out = await fleet.generate(prompt(30, 40))
    assert out.replica_id == "rep-c" and out.usage.completion_tokens == 2


async def test_n_samples_that_finish_in_one_step_each_deliver_their_last_message(fleet):
    """n=2 siblings reach max_tokens in the same engine step: both final messages arrive
    (the engine loop used to drop the request's stream after the first of them)."""
    server = await fleet.add_replica("rep-a")
    channel = grpc.aio.insecure_channel(server.address)
    try:
        call = worker_pb2_grpc.WorkerStub(channel).GenerateStream()
        await call.write(generate_frame(1, prompt(4, 20), max_tokens=3, n=2))
        frames = (await collect(call, [1]))[1]
        finals = sorted(f.message.index for f in frames if f.message.finish_reason)
        assert finals == [0, 1] and frames[-1].done and frames[-1].status_code == 0
        assert all(f.message.usage.completion_tokens == 3 for f in frames if f.message.finish_reason)
        call.cancel()
    finally:
        await channel.close()
