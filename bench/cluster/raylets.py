"""A multi-node Ray cluster on one machine: ``ray start --head`` plus ``ray start --address``
raylets, each standing in for a host, told apart by a custom resource named after it
(``node-1``, ``node-2``, …).

Every ``ray start`` runs in its own session, so a node's daemons (raylet, agents, log monitor;
on the head also GCS and dashboard) share one process group, and its worker processes are
the raylet's children: :meth:`RayletCluster.kill_node` SIGKILLs both at once, the way a host
that loses power takes its processes with it. Nothing here calls ``ray stop``, which stops
every Ray on the machine, other users' included.

Ports are picked free (the node-manager, object-manager and worker ports by Ray), so several
such clusters and a test session's own Ray can share the machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import psutil

from kvfleet.deploy.ray_local import RAY_ENV, free_port

HOST = "127.0.0.1"
# Joining a cluster needs multi-node mode on; the loopback node IP keeps Ray's traffic local.
NODE_ENV = {**RAY_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
NODE_OBJECT_STORE_BYTES = 128 << 20
# `ray start` gives a raylet 30 s (fixed in Ray) to register with the GCS; on a 2-core machine
# under heavy load that was missed once in a few runs: start it again.
START_ATTEMPTS = 3
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Node:
    """One raylet: its name (= its custom resource), process group and raylet pid."""

    name: str
    pgid: int
    raylet_pid: int


class RayletCluster:
    """Start with :meth:`start_head`, add raylets with :meth:`add_node`, end with :meth:`stop`
    (or use as a context manager). ``address`` is the GCS address for ``--ray-address``."""

    def __init__(self, temp_dir: Optional[str] = None,
                 node_timeout_s: Optional[float] = None) -> None:
        """``node_timeout_s``: the GCS declares a silent raylet dead after about this long
        (1 s health checks; None: Ray's defaults, measured ~12 s here)."""
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="kvf-raylets-")
        self._gcs_env = {}
        if node_timeout_s is not None:
            checks = max(1, round(node_timeout_s))
            self._gcs_env = {"RAY_health_check_period_ms": "1000",
                             "RAY_health_check_timeout_ms": "1000",
                             "RAY_health_check_failure_threshold": str(checks)}
        self._own_temp_dir = temp_dir is None
        self.address: Optional[str] = None
        self.nodes: dict[str, Node] = {}

    def start_head(self, num_cpus: float = 1, name: str = "node-1") -> float:
        """``ray start --head`` (no dashboard UI, small object store); returns its seconds."""
        port = free_port(HOST)
        self.address = f"{HOST}:{port}"
        return self._start(name, num_cpus, ["--head", "--port", str(port), "--include-dashboard",
                                            "false", "--ray-client-server-port",
                                            str(free_port(HOST))], self._gcs_env)

    def add_node(self, name: str, num_cpus: float = 1) -> float:
        """``ray start --address`` a raylet holding ``num_cpus`` CPUs and resource ``name``;
        returns its seconds, retries included (``ray start`` returns once the raylet has
        registered). Raises RuntimeError with ``ray start``'s last line after 3 failures."""
        if self.address is None:
            raise RuntimeError("start_head() first")
        return self._start(name, num_cpus, ["--address", self.address])

    def _start(self, name: str, num_cpus: float, args: list[str],
               env: Optional[dict] = None) -> float:
        if name in self.nodes:
            raise ValueError(f"node {name!r} already runs")
        cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", *args,
               "--node-ip-address", HOST, "--num-cpus", f"{num_cpus:g}",
               "--resources", json.dumps({name: 1}),
               "--object-store-memory", str(NODE_OBJECT_STORE_BYTES),
               "--temp-dir", self.temp_dir, "--disable-usage-stats",
               "--min-worker-port", "0", "--max-worker-port", "0",
               "--dashboard-agent-listen-port", str(free_port(HOST)),
               "--dashboard-agent-grpc-port", str(free_port(HOST)),
               "--runtime-env-agent-port", str(free_port(HOST)),
               "--metrics-export-port", str(free_port(HOST))]
        t0 = time.monotonic()
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.nodes[name] = self._launch(name, cmd, {**os.environ, **NODE_ENV, **(env or {})})
                return time.monotonic() - t0
            except RuntimeError as exc:
                if attempt == START_ATTEMPTS:
                    raise
                log.warning("%s (attempt %d of %d); starting it again", exc, attempt, START_ATTEMPTS)

    @staticmethod
    def _launch(name: str, cmd: list[str], env: dict) -> Node:
        # start_new_session: ray start leads a new process group; its daemons stay in it.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"ray start for {name} did not return within 120 s") from None
        pgid = proc.pid
        raylet = next((p.pid for p in _group(pgid) if p.name() == "raylet"), None)
        if proc.returncode != 0 or raylet is None:
            with _gone():
                os.killpg(pgid, signal.SIGKILL)
            tail = out.strip().splitlines()[-1] if out.strip() else ""
            raise RuntimeError(f"ray start for {name} failed (exit {proc.returncode}"
                               f"{'' if raylet else ', no raylet'}): {tail[-500:]}")
        return Node(name, pgid, raylet)

    def node_names(self) -> dict[str, str]:
        """Ray node id (hex) → node name, for the nodes alive now (asks the GCS from a short
        driver process: this process may be connected to another Ray already)."""
        code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
                "print(json.dumps({n['NodeID']: [k for k in n['Resources'] if k in %r] "
                "for n in ray.nodes() if n['Alive']}))" % (self.address, list(self.nodes)))
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **RAY_ENV},
                             capture_output=True, text=True, timeout=120, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
        return {node_id: names[0] for node_id, names in found.items() if names}

    def rss_bytes(self, name: str, workers: bool = True) -> int:
        """Resident memory of node ``name``'s daemons and (``workers``) its worker processes,
        in bytes."""
        node = self.nodes[name]
        procs = self._processes(node) if workers else _group(node.pgid)
        return sum(_rss(p) for p in procs)

    def kill_node(self, name: str) -> None:
        """SIGKILL node ``name``'s daemons and workers at once (a host crash)."""
        node = self.nodes.pop(name)
        procs = self._processes(node)
        for p in procs:
            with _gone():
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)

    def stop(self) -> None:
        """Kill every node (workers first go with their raylet) and remove the temp dir."""
        for name in list(reversed(self.nodes)):  # the head last
            self.kill_node(name)
        if self._own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _processes(self, node: Node) -> list[psutil.Process]:
        procs = _group(node.pgid)
        with _gone():
            procs += psutil.Process(node.raylet_pid).children(recursive=True)
        return list({p.pid: p for p in procs}.values())

    def __enter__(self) -> "RayletCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid``."""
    found = []
    for p in psutil.process_iter():
        with _gone():
            if os.getpgid(p.pid) == pgid:
                found.append(p)
    return found


def _rss(p: psutil.Process) -> int:
    with _gone():
        return p.memory_info().rss
    return 0


@contextlib.contextmanager
def _gone():
    """Ignore a process that ended meanwhile."""
    try:
        yield
    except (psutil.NoSuchProcess, ProcessLookupError, psutil.AccessDenied):
        pass
