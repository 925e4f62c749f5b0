"""The processes of ``bench.cluster.soak``: a private redis-server, cost-model replicas (one process
each, ``bench.cluster.soak_replica``) and a router process — and the faults it injects into them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bench.common.result_file import ROOT
from kvfleet.deploy.process_relay import wait_ready
from kvfleet.deploy.redis_server import RedisServer, start_redis

NAMESPACE = "bench-soak:"
READY_TIMEOUT_S = 120.0


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process (Linux /proc), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class FleetSpec:
    model_name: str
    model_dir: str
    replicas: int = 2
    scale: float = 0.05          # cost-model step times × scale
    num_blocks: int = 640
    max_num_seqs: int = 16
    stream_max_unread: int = 64  # slow readers are cancelled past these (router and replicas)
    stream_stall_s: float = 2.0


@dataclass
class SoakFleet:
    """Start with :meth:`start`; :meth:`stop` ends every process it started."""

    spec: FleetSpec
    redis: Optional[RedisServer] = None
    redis_port: int = 0
    replicas: dict[str, subprocess.Popen] = field(default_factory=dict)  # replica id → process
    addresses: dict[str, str] = field(default_factory=dict)              # replica id → host:port
    router: Optional[subprocess.Popen] = None
    router_address: str = ""

    def start(self) -> str:
        """Redis, replicas, router; returns the router's address."""
        self.redis = start_redis()
        self.redis_port = self.redis.port
        for i in range(self.spec.replicas):
            self.start_replica(f"replica-{i}")
        s = self.spec
        self.router = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.router.main", "--redis-url", self.redis.url,
             "--model-name", s.model_name, "--model-dir", s.model_dir, "--port", "0",
             "--namespace", NAMESPACE, "--stream-max-unread", str(s.stream_max_unread),
             "--stream-stall-s", str(s.stream_stall_s), "--log-level", "WARNING"],
            stdout=subprocess.PIPE, text=True)
        self.router_address = wait_ready(self.router, "router ready ", READY_TIMEOUT_S)
        return self.router_address

    def start_replica(self, replica_id: str) -> str:
        """(Re)start one replica process under ``replica_id``; returns its address."""
        s = self.spec
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.cluster.soak_replica", "--replica-id", replica_id,
             "--redis-url", self.redis.url, "--model-name", s.model_name,
             "--model-dir", s.model_dir, "--namespace", NAMESPACE, "--scale", str(s.scale),
             "--num-blocks", str(s.num_blocks), "--max-num-seqs", str(s.max_num_seqs),
             "--stream-max-unread", str(s.stream_max_unread),
             "--stream-stall-s", str(s.stream_stall_s)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.replicas[replica_id] = proc
        self.addresses[replica_id] = wait_ready(proc, "replica ready ", READY_TIMEOUT_S)
        return self.addresses[replica_id]

    def kill_replica(self, replica_id: str) -> None:
        """SIGKILL: no deregistration, streams cut, the registry entry left to expire."""
        proc = self.replicas[replica_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_redis(self) -> None:
        self.redis.stop()

    def start_redis_again(self) -> None:
        """A fresh, empty redis-server on the same port (no persistence: the index is gone)."""
        self.redis = start_redis(port=self.redis_port)

    def pids(self) -> dict[str, int]:
        """Live processes by role: router, each replica id, redis."""
        out = {"router": self.router.pid} if self.router else {}
        out.update({rid: p.pid for rid, p in self.replicas.items() if p.poll() is None})
        if self.redis is not None and self.redis.process.poll() is None:
            out["redis"] = self.redis.process.pid
        return out

    def stop(self) -> None:
        procs = [p for p in (self.router, *self.replicas.values()) if p is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        if self.redis is not None:
            self.redis.stop()
