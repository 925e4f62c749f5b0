"""A real two-node Ray cluster on this machine (two raylets started with ``ray start``, see
bench/cluster/raylets.py): ``kvfleet up --ray-address`` spreads its replicas over both nodes, both
serve, and losing the second node is handled like a replica crash: its stream ends
UNAVAILABLE and other requests go to the replica left. Serve's replacement of the lost
replica (a replica start, ~20 s here) is measured by ``python -m bench multinode``.

The cluster is its own Ray, beside the test session's: only subprocesses (``kvfleet up``, a
short driver naming the nodes) connect to it, never this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile

import grpc
import pytest

from bench.cluster.raylets import RayletCluster
from kvfleet.client import Client
from tests.e2e.test_cli import KVFLEET, _wait_ready

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    # 4 logical CPUs a node: a replica's 1-CPU share would fit twice on the first node, so
    # placement on both nodes is kvfleet's spreading, not a lack of room.
    # A lost node is declared dead after ~3 s (Ray's default, ~12 s, suits real networks).
    with RayletCluster(node_timeout_s=3) as cluster:
        cluster.start_head(num_cpus=4, name="node-1")
        cluster.add_node("node-2", num_cpus=4)
        yield cluster


@pytest.fixture(scope="module")
def fleet(two_nodes, smollm2_dir, redis_server):
    """``kvfleet up`` on the two-node cluster: 2 SmolLM2 replicas, round-robin routing (so
    consecutive requests visit both replicas)."""
    # Its own TMPDIR: the cluster file it records for `kvfleet status` stays out of the user's.
    tmp = tempfile.mkdtemp(prefix="kvfmn", dir="/tmp")
    proc = subprocess.Popen(
        [*KVFLEET, "up", "--model", str(smollm2_dir), "--replicas", "2", "--port", "0",
         "--http-port", "-1", "--ray-address", two_nodes.address, "--redis-url",
         redis_server.url, "--kv-memory", "32MiB", "--policy", "round_robin"],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": tmp}, start_new_session=True)
    try:
        yield proc, _wait_ready(proc, 240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _placement(client: Client, names: dict[str, str]) -> dict[str, str]:
    """replica id → the name of the node its rank 0 runs on."""
    return {r.replica_id: names.get(r.ranks[0].node_id, r.ranks[0].node_id)
            for r in client.cluster_status().replicas}


def test_replicas_spread_over_both_nodes_serve_and_survive_losing_one(two_nodes, fleet):
    _, address = fleet
    names = two_nodes.node_names()
    assert sorted(names.values()) == ["node-1", "node-2"]
    with Client(address) as client:
        placement = _placement(client, names)
        assert sorted(placement.values()) == ["node-1", "node-2"], placement
        # `kvfleet status`, from another process, shows the same placement.
        out = subprocess.run([*KVFLEET, "status", "--address", two_nodes.address, "--json"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        rows = json.loads(out)["applications"][0]["replicas"]
        assert {r["replica_id"]: names[r["ranks"][0]["node"]] for r in rows} == placement
        on_node_2 = next(r for r, node in placement.items() if node == "node-2")
        # Round robin visits the replicas in id order: request k goes to sorted ids[k % 2].
        served = [list(client.stream(prompt=f"Say {i}.", max_tokens=2))[-1].replica_id
                  for i in range(2)]
        assert served == sorted(placement)
        if served[0] != on_node_2:
            client.generate("Say 2.", max_tokens=2)
        # So this long stream runs on node 2's replica.
        stream = client.stream(prompt="Count to a thousand:", max_tokens=400, ignore_eos=True)
        next(stream)
        two_nodes.kill_node("node-2")

        # The started stream ends UNAVAILABLE, as a crashed replica's streams do ...
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # ... and every request after it is served by the replica on node 1.
        on_node_1 = next(r for r, node in placement.items() if node == "node-1")
        for i in range(4):
            assert list(client.stream(prompt=f"Again {i}.", max_tokens=2))[-1].replica_id == on_node_1
