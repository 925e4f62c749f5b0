"""A tensor-parallel replica whose rank dies or hangs fails fast and alone: its streams end
UNAVAILABLE naming the rank within seconds, it leaves the registry, its ranks are released,
the other replicas keep serving, and Ray Serve replaces it (its health check fails). Idle
ranks outlive many collective timeouts.

One cluster for the module: two tp=2 replicas of the tiny Llama behind a router, collectives
timed out after 3 s. The kill and hang tests each take one replica down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import grpc
import pytest

from kvfleet.client import Client
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.router.config import RouterConfig
from kvfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvfleet.worker.executor.tp.group import TPSettings
from tests.fixtures.cluster import cluster_with_client, tiny_replica

pytestmark = pytest.mark.slow

COLLECTIVE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def tp_cluster(ray_session, redis_server, tiny_llama_dir):
    replica = tiny_replica(tiny_llama_dir, redis_server.url, "kvtest-tp:", tensor_parallel_size=2,
                           tp=TPSettings(collective_timeout_s=COLLECTIVE_TIMEOUT_S, step_timeout_s=3.0))
    cfg = ClusterConfig(replica, RouterConfig(port=0), replicas=2, replica_num_cpus=0)
    with cluster_with_client(cfg) as running:
        yield running


def replicas(client: Client) -> dict:
    return {r.replica_id: r for r in client.cluster_status().replicas}


def direct(address: str, rid: str, max_tokens: int = 4) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid, prompt_token_ids=list(range(100, 120)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def generate_on(address: str, rid: str, max_tokens: int = 4) -> int:
    """Tokens one direct Worker.Generate call streamed."""
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))
    return sum(len(m.token_ids) for m in stub.Generate(direct(address, rid, max_tokens), timeout=30))


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_ranks_are_reported_and_serve_after_idling_three_collective_timeouts(tp_cluster) -> None:
    _, client = tp_cluster
    deadline = time.monotonic() + 30
    while len(replicas(client)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    found = replicas(client)
    assert len(found) == 2
    for r in found.values():
        assert r.tensor_parallel_size == 2 and [k.rank for k in r.ranks] == [0, 1]
        assert len({k.pid for k in r.ranks}) == 2 and {k.num_blocks for k in r.ranks} == {64}
        stats = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(r.address)).Stats(
            worker_pb2.StatsRequest())
        assert stats.tensor_parallel_size == 2
        assert [k.pid for k in stats.ranks] == [k.pid for k in r.ranks]
    time.sleep(3 * COLLECTIVE_TIMEOUT_S + 1)
    for r in found.values():
        assert generate_on(r.address, f"after-idle-{r.replica_id}") == 4


def _fail_one_rank(tp_cluster, sig: int, expect: str, replaced: bool) -> None:
    """Fail rank 1 of one replica with ``sig``; ``replaced``: also wait for Serve's
    replacement (one test checks it: each wait is a replica start)."""
    _, client = tp_cluster
    tp_cluster[0].wait_serving(2)
    victim, *others = sorted(replicas(client).values(), key=lambda r: r.replica_id)
    pid = victim.ranks[1].pid
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(victim.address))
    ended: dict[int, tuple] = {}
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        call = stub.Generate(direct(victim.address, f"victim-{sig}-{i}", max_tokens=200))
        try:
            next(iter(call))
            started.wait(10)
            for _ in call:
                pass
            ended[i] = ("OK", "", time.monotonic())
        except grpc.RpcError as exc:
            ended[i] = (exc.code(), exc.details(), time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(10)
    os.kill(pid, sig)
    hit = time.monotonic()
    for t in threads:
        t.join(30)
    try:
        for code, details, at in ended.values():
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "rank 1" in details and expect in details, details
            assert at - hit < 10
        assert len(ended) == 3
        # New requests are refused at once, the router forgets the replica, the rank is gone.
        with pytest.raises(grpc.RpcError) as err:
            generate_on(victim.address, f"after-{sig}")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 10
        while victim.replica_id in replicas(client) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert victim.replica_id not in replicas(client)
        assert gone(pid), f"rank 1 (pid {pid}) still runs"
        assert client.generate("Still serving?", max_tokens=4)
        for r in others:
            if r.replica_id in replicas(client):
                assert generate_on(r.address, f"other-{sig}-{r.replica_id}") == 4
        if not replaced:
            return
        # Serve saw the failed health check and replaced the replica (new id, new ranks).
        back = tp_cluster[0].wait_serving(2, timeout_s=120)
        print(f"\nrank {sig} failure: 2 replicas serving again "
              f"{time.monotonic() - hit:.1f} s after the signal")
        assert victim.replica_id not in {r.replica_id for r in back}
    finally:
        if sig == signal.SIGSTOP:  # never leave a stopped process behind a failed assert
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_rank_fails_its_replica_within_seconds(tp_cluster) -> None:
    _fail_one_rank(tp_cluster, signal.SIGKILL, "died", replaced=True)


def test_a_hung_rank_fails_its_replica_within_seconds(tp_cluster) -> None:
    _fail_one_rank(tp_cluster, signal.SIGSTOP, "stopped answering", replaced=False)


def test_a_hung_rank_0_ends_the_routers_streams_and_its_ranks_exit(tp_cluster) -> None:
    """The replica process itself hangs (no watchdog of its own can act): the router's
    keep-alive pings go unanswered, its streams there end UNAVAILABLE; the other ranks, cut off,
    leave within the collective timeout."""
    cluster, client = tp_cluster
    (last,) = cluster.scale(1)  # one replica: the router's stream surely goes there
    rank0, rank1 = (k["pid"] for k in last.ranks)
    stream = client.stream("Count to a thousand:", max_tokens=220, ignore_eos=True)
    try:
        next(stream)
        os.kill(rank0, signal.SIGSTOP)
        hit = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert time.monotonic() - hit < 30
        assert gone(rank1, 3 * COLLECTIVE_TIMEOUT_S + 5), "rank 1 outlived its rank 0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank0, signal.SIGKILL)
