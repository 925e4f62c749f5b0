"""Multi-node Ray on one machine: raylet start time and memory, `kvfleet up --ray-address`
placement, time to serve after raylets join, and a lost node under steady traffic.

``python -m bench multinode`` (~3 min on 2 quiet cores). Scenario, on real SmolLM2 replicas:

1. ``ray start --head`` with 0 CPUs (as the KubeRay head group: no replica lands there) and
   one raylet (``node-2``, 1 CPU); a cluster of 2 replicas of 1 CPU joins it (``LocalCluster``
   with ``ray_address``, what ``kvfleet up --ray-address`` runs): replica 1 serves, replica 2
   waits for room;
2. ``node-3`` (1 CPU) joins: time until both replicas serve, where they went (ClusterStatus:
   every rank's Ray node) and each node's memory;
3. a client sends one short request after another; ``node-3`` is SIGKILLed (daemons and
   workers, as a host that loses power): failed requests and their errors, time until the
   lost replica leaves the status view; then ``node-4`` joins and Serve's replacement for the
   lost replica serves there: time from that join. Ray's default node health checks unless
   ``--node-timeout``.

JSON goes to ``--out`` (default ``bench/results/multinode.json``); docs/history/multinode.md holds runs.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Optional

from bench.cluster.raylets import RayletCluster
from kvfleet.client import Client
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.deploy.launcher import LocalCluster
from kvfleet.deploy.models import prepare_model
from kvfleet.deploy.ray_local import init_ray
from kvfleet.router.config import RouterConfig
from kvfleet.worker.replica.replica import ReplicaConfig


def _placement(client: Client, names: dict[str, str]) -> dict[str, str]:
    return {r.replica_id: names.get(r.ranks[0].node_id, r.ranks[0].node_id[:8])
            for r in client.cluster_status().replicas}


class Traffic:
    """One short request after another from a thread; records (time, ok, replica or error)."""

    def __init__(self, address: str) -> None:
        self.client = Client(address)
        self.events: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                last = list(self.client.stream(prompt=f"Say {i}.", max_tokens=4, timeout=30))[-1]
                self.events.append((time.monotonic(), True, last.replica_id))
            except Exception as exc:  # a gRPC error: what the client of a lost node sees
                code = getattr(exc, "code", lambda: None)()
                self.events.append((time.monotonic(), False, str(code or exc)[:80]))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


def _wait_placement(client: Client, names: dict[str, str], done, timeout_s: float = 300):
    """Polls ClusterStatus until ``done(placement)``; returns (seconds, placement)."""
    t0 = time.monotonic()
    while True:
        now = _placement(client, names)
        if done(now) or time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, now
        time.sleep(0.1)


def run(node_timeout_s: Optional[float]) -> dict:
    import ray

    model = prepare_model(progress=False)
    out: dict = {"node_timeout_s": node_timeout_s}
    with RayletCluster(node_timeout_s=node_timeout_s) as raylets:
        out["head_start_s"] = raylets.start_head(num_cpus=0, name="node-1")
        out["node_start_s"] = {"node-2": raylets.add_node("node-2", 1)}
        # 1 CPU a replica, 1 a node: replica 2 can only run on a node that has yet to join.
        replica = ReplicaConfig(model.name, model.name, str(model), kv_memory_bytes=32 << 20)
        cfg = ClusterConfig(replica, RouterConfig(port=0, policy="round_robin"), replicas=2,
                            ray_address=raylets.address, replica_num_cpus=1.0)
        init_ray(raylets.address)  # here, in the main thread (Ray sets signal handlers)
        cluster = LocalCluster(cfg)
        failure: list[BaseException] = []

        def start() -> None:
            try:
                cluster.start()
            except BaseException as exc:  # re-raised below, in the main thread
                failure.append(exc)

        starter = threading.Thread(target=start)
        try:
            starter.start()
            time.sleep(8.0)  # the Serve config is applied; replica 1 runs, replica 2 waits
            t_join = time.monotonic()
            out["node_start_s"]["node-3"] = raylets.add_node("node-3", 1)
            starter.join(600)
            if failure:
                raise failure[0]
            out["serving_after_join_s"] = time.monotonic() - t_join
            out["rss_mib"] = {n: {"daemons": raylets.rss_bytes(n, workers=False) >> 20,
                                  "with_workers": raylets.rss_bytes(n) >> 20}
                              for n in raylets.nodes}
            names = raylets.node_names()
            with Client(cluster.router_address) as client:
                out["placement"] = placement = _placement(client, names)
                lost = next(r for r, n in placement.items() if n == "node-3")
                traffic = Traffic(cluster.router_address)
                time.sleep(3.0)
                t_kill = time.monotonic()
                raylets.kill_node("node-3")
                out["status_drops_lost_s"], _ = _wait_placement(
                    client, names, lambda now: lost not in now)
                # No room left for Serve's replacement until a node joins again.
                time.sleep(5.0)
                t_join = time.monotonic()
                out["node_start_s"]["node-4"] = raylets.add_node("node-4", 1)
                names = raylets.node_names()
                _, now = _wait_placement(client, names, lambda now: len(now) == 2)
                out["replacement_serving_after_join_s"] = time.monotonic() - t_join
                out["after_loss_placement"] = now
                time.sleep(2.0)
                traffic.stop()
            after = [(t - t_kill, ok, what) for t, ok, what in traffic.events if t >= t_kill]
            failed = [e for e in after if not e[1]]
            out["loss"] = {
                "requests_after_kill": len(after), "failed": len(failed),
                "errors": sorted({e[2] for e in failed}),
                "last_failure_s": max((e[0] for e in failed), default=None),
                "first_success_s": min((e[0] for e in after if e[1]), default=None),
                "served_by_lost_after_kill": sum(1 for e in after if e[1] and e[2] == lost),
                "served_by_replacement": sum(1 for e in after if e[1] and e[2] not in placement)}
        finally:
            starter.join(600)
            cluster.stop()
            ray.shutdown()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench multinode", description=__doc__.split("\n\n")[0])
    p.add_argument("--node-timeout", type=float, default=None,
                   help="seconds until the GCS declares a silent raylet dead (default: Ray's)")
    p.add_argument("--out", default="bench/results/multinode.json")
    args = p.parse_args(argv)
    result = run(args.node_timeout)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0
