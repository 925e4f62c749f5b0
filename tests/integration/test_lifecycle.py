"""Replicas on Ray Serve under traffic: scale 2 → 3 → 1, drain on scale-down, Worker.Drain past
its timeout, a killed replica replaced, a rolling upgrade — no failed request where none may
fail. One cluster for the module (tiny Llama, drain timeout 20 s: long enough for a 200-token
stream on a loaded machine; the Worker.Drain test passes its own short timeout); each test first
sets the fleet to the size it needs, so any one runs alone (``-k``). In file order (kill,
upgrade, scale, Worker.Drain, drain on scale-down) most tests find the size the one before
left: 8 replica starts in the module where the order above takes 9.

Timings are printed (``-s``), never asserted; ``docs/operating.md`` lists measured ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import redis

from kvfleet.client import Client
from kvfleet.deploy import serve_control
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.deploy.registry_view import wait_gone
from kvfleet.index_keys import IndexKeys
from kvfleet.router.config import RouterConfig
from kvfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.fixtures.cluster import cluster_with_client, tiny_replica

pytestmark = pytest.mark.slow
NAMESPACE = "kvtest-life:"


@pytest.fixture(scope="module")
def life(ray_session, redis_server, tiny_llama_dir):
    cfg = ClusterConfig(tiny_replica(tiny_llama_dir, redis_server.url, NAMESPACE, drain_timeout_s=20.0),
                        RouterConfig(port=0), replicas=2, replica_num_cpus=0,
                        health_check_period_s=0.5)
    with cluster_with_client(cfg) as running:
        yield running


class Traffic:
    """Short requests through the router from two threads until :meth:`stop`; records each
    outcome with its start time and replica."""

    def __init__(self, client: Client, threads: int = 2) -> None:
        self.client = client
        self.ok: list[tuple[float, str]] = []  # (start, replica_id)
        self.failed: list[tuple[float, str]] = []  # (start, "CODE: details")
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            start = time.monotonic()
            try:
                last = list(self.client.stream(f"Request {i}-{n}: tell a story about",
                                               max_tokens=3, ignore_eos=True, timeout=60))[-1]
                self.ok.append((start, last.replica_id))
            except grpc.RpcError as exc:
                self.failed.append((start, f"{exc.code().name}: {exc.details()}"))

    def first_on(self, replica_ids: set[str], after: float) -> float | None:
        """Start time of the first request served by one of ``replica_ids`` after ``after``."""
        found = [s for s, rid in self.ok if rid in replica_ids and s >= after]
        return min(found) if found else None


def index_mentions(redis_url: str, replica_id: str) -> int:
    """Index entries (block keys, held set, load record) that name ``replica_id``."""
    keys = IndexKeys(NAMESPACE)
    r = redis.Redis.from_url(redis_url)
    try:
        n = r.exists(keys.held(replica_id), keys.load(replica_id))
        for key in r.scan_iter(match=keys.block_prefix + "*", count=1000):
            n += r.hexists(key, replica_id)
        return n
    finally:
        r.close()


def _running(address: str) -> int:
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))
    return stub.Stats(worker_pb2.StatsRequest(), timeout=5).running


def test_a_killed_replica_is_replaced_and_only_its_started_streams_fail(life) -> None:
    cluster, client = life
    infos = cluster.scale(2)
    victim = infos[0]
    host = next(r for r in cluster.serve_replicas() if r["replica_id"] == victim.serve_replica)
    long_streams: list = []

    def long_stream() -> None:
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(victim.address))
        req = worker_pb2.WorkerGenerateRequest(
            request_id=f"crash-{time.monotonic()}", prompt_token_ids=list(range(100, 120)),
            sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True))
        try:
            for _ in stub.Generate(req, timeout=60):
                pass
            long_streams.append(("OK", "", time.monotonic()))
        except grpc.RpcError as exc:
            long_streams.append((exc.code(), exc.details(), time.monotonic()))

    with Traffic(client) as traffic:
        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.monotonic() + 10
        while not _running(victim.address) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(host["pid"], signal.SIGKILL)
        killed = time.monotonic()
        t.join(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = {i.replica_id: i for i in cluster.registered() if i.state == "serving"}
            new = set(now) - {i.replica_id for i in infos}
            if new:
                break
            time.sleep(0.1)
        serving = time.monotonic() - killed
        first = None
        while first is None and time.monotonic() < deadline:
            first = traffic.first_on(new, killed)
            time.sleep(0.05)
    ((code, _, at),) = long_streams
    print(f"\ncrash: stream ended {at - killed:.2f} s after SIGKILL; replacement serving "
          f"{serving:.1f} s after; first routed request to it {(first or killed) - killed:.1f} s")
    assert code == grpc.StatusCode.UNAVAILABLE
    assert new and first is not None
    # Requests sent after the kill went elsewhere (none had started on the victim).
    late = [f for s, f in traffic.failed if s > killed + 0.05]
    assert late == [], late
    (replacement,) = new
    assert now[replacement].epoch >= 1 and now[replacement].serve_replica != victim.serve_replica
    cluster.wait_serving(2)


def test_a_rolling_upgrade_under_traffic_fails_no_request(life) -> None:
    """``kvfleet upgrade`` from another process (as an operator runs it) rolls both replicas
    while traffic flows: no request fails, every replica is new, the config says rev-2."""
    import ray

    cluster, client = life
    old = {i.serve_replica for i in cluster.scale(2)}
    address = ray.get_runtime_context().gcs_address
    upgrade = [sys.executable, "-m", "kvfleet.deploy.cli", "upgrade", "--address", address,
               "--namespace", NAMESPACE, "--revision", "rev-2", "--timeout", "240"]
    with Traffic(client) as traffic:
        time.sleep(0.5)
        t0 = time.monotonic()
        out = subprocess.run(upgrade, capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
        time.sleep(0.5)
    print(f"\nrolling upgrade of 2 replicas (kvfleet upgrade): {took:.1f} s, "
          f"{len(traffic.ok)} requests served")
    assert out.returncode == 0, out.stderr[-3000:]
    assert traffic.failed == [] and len(traffic.ok) > 10
    new = cluster.wait_serving(2)
    assert len(out.stdout.splitlines()) == 2 and not old & {i.serve_replica for i in new}
    assert serve_control.app_configs()[cluster.app_name]["args"]["revision"] == "rev-2"
    # A bad --model-dir: tests/unit/deploy/test_cli_args.py (it fails before connecting).


def test_scale_2_to_3_to_1_under_traffic_serves_every_request(life, redis_server) -> None:
    cluster, client = life
    before = {i.replica_id for i in cluster.scale(2)}
    # More requests in flight than replicas: least-loaded routing reaches the new one.
    with Traffic(client, threads=4) as traffic:
        time.sleep(1.0)
        t0 = time.monotonic()
        grown = {i.replica_id for i in cluster.scale(3)}
        registered = time.monotonic() - t0
        added = grown - before
        deadline = time.monotonic() + 20
        while traffic.first_on(added, t0) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first = traffic.first_on(added, t0)
        t1 = time.monotonic()
        kept = {i.replica_id for i in cluster.scale(1)}
        shrunk = time.monotonic() - t1
        time.sleep(1.0)
    print(f"\nscale 2→3: serving in {registered:.1f} s, first routed request "
          f"{(first or t0) - t0:.1f} s after the apply; 3→1 in {shrunk:.1f} s; "
          f"{len(traffic.ok)} requests")
    assert len(added) == 1 and first is not None
    assert traffic.failed == [] and len(traffic.ok) > 10
    assert {rid for _, rid in traffic.ok} >= added
    removed = grown - kept
    assert len(kept) == 1 and len(removed) == 2
    assert wait_gone(redis_server.url, NAMESPACE, removed)
    for rid in removed:
        assert index_mentions(redis_server.url, rid) == 0, rid


def test_worker_drain_past_its_timeout_ends_streams_unavailable_and_serve_replaces_it(life) -> None:
    cluster, client = life
    (victim,) = cluster.scale(1)
    ended: list = []

    def stream() -> None:
        try:
            list(client.stream("Drained story:", max_tokens=200, ignore_eos=True, timeout=60))
            ended.append(("OK", ""))
        except grpc.RpcError as exc:
            ended.append((exc.code(), exc.details()))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 10
    while not _running(victim.address) and time.monotonic() < deadline:
        time.sleep(0.01)
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(victim.address))
    reply = stub.Drain(worker_pb2.DrainRequest(timeout_s=0.05), timeout=30)
    t.join(30)
    assert reply.running == 1 and reply.ended_by_timeout == 1
    ((code, details),) = ended
    assert code == grpc.StatusCode.UNAVAILABLE and "drain" in details, details
    t0 = time.monotonic()
    (replacement,) = cluster.wait_serving(1)
    print(f"\nWorker.Drain: replacement serving {time.monotonic() - t0:.1f} s after the drain")
    assert replacement.replica_id != victim.replica_id
    assert client.generate("Served again?", max_tokens=2)


def test_lowering_num_replicas_drains_the_streams_of_whichever_replica_goes(life) -> None:
    cluster, client = life
    infos = cluster.scale(2)
    results: list = []

    def stream(i: int) -> None:
        try:
            chunks = list(client.stream(f"Long story {i}:", max_tokens=200, ignore_eos=True,
                                        timeout=120))
            results.append(("OK", chunks[-1].completion_tokens, chunks[-1].replica_id))
        except grpc.RpcError as exc:
            results.append((exc.code().name, exc.details(), ""))

    threads = []
    deadline = time.monotonic() + 30
    while not all(_running(i.address) for i in infos) and time.monotonic() < deadline:
        t = threading.Thread(target=stream, args=(len(threads),))
        t.start()
        threads.append(t)
        time.sleep(0.1)
    assert all(_running(i.address) for i in infos), "a replica got no stream"
    t0 = time.monotonic()
    serve_control.set_replicas(cluster.app_name, 1)
    for t in threads:
        t.join(120)
    print(f"\ndrain on scale-down: {len(threads)} streams done {time.monotonic() - t0:.1f} s "
          f"after the apply")
    assert len(results) == len(threads)
    assert all(r[0] == "OK" and r[1] == 200 for r in results), results
    assert len({r[2] for r in results}) == 2  # both replicas streamed
    cluster.wait_serving(1)
