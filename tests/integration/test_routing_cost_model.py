"""``kvfleet up --executor cost-model``: many replicas in one Ray actor behind the real router."""

from __future__ import annotations

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


def test_cost_model_replicas_share_one_process_and_serve(ray_session, redis_server, tiny_llama_dir):
    args = build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--replicas", "3",
         "--cost-model-scale", "0.001", "--num-blocks", "64", "--port", "0",
         "--redis-url", redis_server.url])
    cfg = cluster_config(args)
    from dataclasses import replace

    cluster = LocalCluster(replace(cfg, replica=replace(cfg.replica, namespace="kvtest-costmodel:"),
                                   replica_num_cpus=0))
    try:
        cluster.start()
        assert len(cluster.serve_replicas()) == 1 and len(cluster.replica_addresses) == 3
        with Client(cluster.router_address) as client:
            deadline = time.monotonic() + 20
            while len(client.cluster_status().replicas) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(client.cluster_status().replicas) == 3
            prompt = "Once upon a time, " * 12
            first = list(client.stream(prompt, max_tokens=4, ignore_eos=True))[-1]
            wait_indexed(cluster, client, first.replica_id, text=prompt)
            again = list(client.stream(prompt, max_tokens=4, ignore_eos=True))[-1]
        assert first.completion_tokens == 4 and first.text
        assert again.replica_id == first.replica_id and again.cached_prompt_tokens > 0
    finally:
        cluster.stop()
