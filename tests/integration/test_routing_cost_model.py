"""``kvfleet up --executor cost-model``: cost-model replicas behind the real router, each in
its own process (one killed, the others serve on), listed by the router once ready."""

from __future__ import annotations

import os
import signal
import time

from kvfleet.client import Client
from kvfleet.deploy.cli import build_parser
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.deploy.launcher import LocalCluster
from tests.fixtures.cluster import wait_indexed


def test_cli_builds_a_cost_model_cluster_config(tiny_llama_dir):
    args = build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--replicas", "3",
         "--cost-model-scale", "0.5"])
    cfg = cluster_config(args)
    from kvfleet.worker.executor.cost_model import MEASURED

    assert cfg.replica.executor == "cost-model" and cfg.replicas == 3
    assert cfg.replica.cost_model.prefill_token_s == MEASURED.prefill_token_s * 0.5


def test_cost_model_replicas_fail_alone_and_ready_means_listed(ray_session, redis_server,
                                                               tiny_llama_dir):
    args = build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--replicas", "2",
         "--cost-model-scale", "0.001", "--num-blocks", "64", "--port", "0",
         "--redis-url", redis_server.url])
    cfg = cluster_config(args)
    from dataclasses import replace

    cluster = LocalCluster(replace(cfg, replica=replace(cfg.replica, namespace="kvtest-costmodel:"),
                                   replica_num_cpus=0))
    try:
        cluster.start()
        with Client(cluster.router_address) as client:
            assert len(client.cluster_status().replicas) == 2  # listed once ready
            pids = {r["replica_id"]: r["pid"] for r in cluster.serve_replicas()}
            assert len(set(pids.values())) == 2  # a process each
            prompt = "Once upon a time, " * 12
            first = list(client.stream(prompt, max_tokens=4, ignore_eos=True))[-1]
            wait_indexed(cluster, client, first.replica_id, text=prompt)
            again = list(client.stream(prompt, max_tokens=4, ignore_eos=True))[-1]
            assert first.completion_tokens == 4 and first.text
            assert again.replica_id == first.replica_id and again.cached_prompt_tokens > 0
            hosts = {i.replica_id: i.serve_replica for i in cluster.registered()}
            survivor = next(rid for rid in hosts if rid != first.replica_id)
            os.kill(pids[hosts[first.replica_id]], signal.SIGKILL)
            # The other replica serves on, under its own id, in its own process.
            for _ in range(4):
                out = list(client.stream(prompt, max_tokens=4, ignore_eos=True))[-1]
                assert out.completion_tokens == 4 and out.replica_id != first.replica_id
            assert survivor in {i.replica_id for i in cluster.registered()}
            # Serve's view of its replicas is polled by its controller: it may still be
            # settling the kill, so wait (bounded) for the survivor to be listed RUNNING again.
            deadline = time.monotonic() + 30
            running: set = set()
            while time.monotonic() < deadline:
                running = {r["pid"] for r in cluster.serve_replicas() if r["state"] == "RUNNING"}
                if pids[hosts[survivor]] in running:
                    break
                time.sleep(0.2)
            assert pids[hosts[survivor]] in running
    finally:
        cluster.stop()
