"""Local cluster launcher: a private redis-server (unless given), a local Ray (or an existing
one), N worker replicas as Ray actors and the router as its own process.

Ray is started with the settings measured in ENVIRONMENT.md: no dashboard, a 512 MiB object
store, every listener on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Optional, TextIO

from kvfleet.deploy.redis_server import RedisServer, start_redis
from kvfleet.index_keys import DEFAULT_NAMESPACE
from kvfleet.telemetry import TelemetryConfig
from kvfleet.tls import FILES as TLS_FILES
from kvfleet.tls import generate_internal_tls
from kvfleet.worker.cost_model import CostModel
from kvfleet.worker.parallel.group import TPSettings, wait_placed
from kvfleet.worker.replica import EXECUTORS, ReplicaConfig
from kvfleet.worker.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep Ray's listeners on loopback
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_DEDUP_LOGS": "0",
}
RAY_OBJECT_STORE_BYTES = 512 << 20
# Replica actors over a multi-node Ray: one per node in turn. Ray's default packs small CPU
# shares onto the driver's node (measured: 2 replicas of 0.1 CPU both on node 1 of 2).
# Tensor-parallel replicas need nothing more: each STRICT_PACK placement group already went
# to the least-used node (measured: 4 groups alternated over 2 nodes).
SPREAD = "SPREAD"


@dataclass(frozen=True)
class ClusterConfig:
    """What ``kvfleet up`` starts. Sizes: ``kv_memory_bytes`` in bytes per replica."""

    model_name: str
    model_dir: str
    replicas: int = 2
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_memory_bytes: Optional[int] = None
    dtype: str = "float32"
    one_row_weights: bool = True  # see ReplicaConfig
    policy: str = "prefix_aware"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: Optional[int] = None  # the router's OpenAI-compatible HTTP front (0: a free port)
    redis_url: Optional[str] = None
    ray_address: Optional[str] = None
    namespace: str = DEFAULT_NAMESPACE
    api_keys_file: Optional[str] = None
    ray_num_cpus: Optional[int] = None
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # OTLP export settings
    # Prometheus: the router on metrics_port, replica i on metrics_port + 1 + i (0: free ports).
    metrics_port: Optional[int] = None
    # CPUs each replica actor reserves in Ray (default: the free CPUs shared out, at most 1;
    # 0 lets a second cluster share a Ray whose CPUs another one holds, as tests do).
    replica_num_cpus: Optional[float] = None
    # "cost-model": replicas whose forward is the cost model (kvfleet.worker.cost_model),
    # up to replicas_per_host of them sharing one process (Ray actor).
    executor: str = "model"
    cost_model: Optional[CostModel] = None
    replicas_per_host: int = 64
    router_args: tuple[str, ...] = ()  # extra router command-line arguments (policy knobs)
    # Ranks per replica: rank 0 is the replica actor, ranks 1..T-1 Ray actors in its
    # placement group (one bundle per rank, STRICT_PACK).
    tensor_parallel_size: int = 1
    tp: TPSettings = field(default_factory=TPSettings)
    device: str = "cpu"
    tls_cert: Optional[str] = None  # PEM files: the router's client port over TLS
    tls_key: Optional[str] = None
    # Mutual TLS router <-> workers with this directory's cluster CA (kvfleet.tls); generated
    # there when it holds no certificates yet.
    internal_tls_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.executor != "model":
            raise ValueError("--tp > 1 needs --executor model")
        if self.executor not in EXECUTORS:
            raise ValueError(f"--executor must be one of {EXECUTORS}, got {self.executor!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")


def check_port_free(host: str, port: int) -> None:
    """Raises OSError naming the port if something already listens there (port 0: no check)."""
    if port == 0:
        return
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"router port {host}:{port} is already in use "
                          f"(pick another with --port, or --port 0 for a free one)") from exc


def free_port(host: str) -> int:
    """A port nothing listens on right now (for a child that must be told its port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None,
             log_to_driver: bool = False) -> None:
    """Start a local Ray head with small caps, or join ``address``. Idempotent (a Ray already
    initialised keeps its settings). ``log_to_driver``: print the actors' stdout and stderr
    here too (else they stay in Ray's session logs, deleted with a Ray started here)."""
    import ray

    os.environ.update(RAY_ENV)
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return
    global _ray_temp_dir
    _ray_temp_dir = tempfile.mkdtemp(prefix="kvf-ray-")
    ray.init(num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False,
             object_store_memory=RAY_OBJECT_STORE_BYTES, log_to_driver=log_to_driver,
             _temp_dir=_ray_temp_dir, runtime_env={"env_vars": dict(RAY_ENV)})


_ray_temp_dir: Optional[str] = None  # the session directory of a Ray that init_ray started


def shutdown_ray() -> None:
    """Stop the Ray that :func:`init_ray` started here and remove its session directory."""
    import ray

    global _ray_temp_dir
    ray.shutdown()
    if _ray_temp_dir is not None:
        shutil.rmtree(_ray_temp_dir, ignore_errors=True)
        _ray_temp_dir = None


class LocalCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.redis: Optional[RedisServer] = None
        self.redis_url: Optional[str] = cfg.redis_url
        self.actors: list = []
        self.placement_groups: list = []  # one per tensor-parallel replica
        self.replica_addresses: list[str] = []
        self.router_proc: Optional[subprocess.Popen] = None
        self.router_address: Optional[str] = None
        self.metrics_addresses: dict[str, str] = {}  # "router" / "replica-<i>" → host:port
        self.http_address: Optional[str] = None  # the router's HTTP front, when on
        self._started_ray = False

    def start(self, timeout_s: float = 300.0) -> str:
        """Start everything; returns the router address. Cleans up what it started on failure."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> str:
        import ray

        cfg = self.cfg
        check_port_free(cfg.host, cfg.port)
        if self.redis_url is None:
            self.redis = start_redis()
            self.redis_url = self.redis.url
        self._started_ray = not ray.is_initialized() and not cfg.ray_address
        # A console exporter prints the replicas' spans on their stdout: show them here.
        init_ray(cfg.ray_address, cfg.ray_num_cpus, log_to_driver=cfg.telemetry.exports_to_stdout)
        if cfg.internal_tls_dir and not all(
                os.path.exists(os.path.join(cfg.internal_tls_dir, f)) for f in TLS_FILES):
            generate_internal_tls(cfg.internal_tls_dir)
        cpus = float(ray.available_resources().get("CPU", 1.0))
        per_replica = max(0.1, min(1.0, cpus / cfg.replicas))
        if cfg.replica_num_cpus is not None:
            per_replica = cfg.replica_num_cpus
        threads = max(1, (os.cpu_count() or 1) // cfg.replicas)
        run_id = uuid.uuid4().hex[:6]
        rcfgs = [ReplicaConfig(
            replica_id=f"replica-{i}-{run_id}", model_name=cfg.model_name,
            model_dir=cfg.model_dir, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
            kv_memory_bytes=cfg.kv_memory_bytes, dtype=cfg.dtype,
            one_row_weights=cfg.one_row_weights, scheduler=cfg.scheduler,
            redis_url=self.redis_url, namespace=cfg.namespace, num_threads=threads,
            telemetry=replace(cfg.telemetry, metrics_port=self._metrics_port(1 + i)),
            executor=cfg.executor, cost_model=cfg.cost_model,
            tensor_parallel_size=cfg.tensor_parallel_size, tp=cfg.tp, device=cfg.device,
            internal_tls_dir=cfg.internal_tls_dir) for i in range(cfg.replicas)]
        if cfg.executor == "cost-model":
            self._start_hosts(rcfgs, per_replica, timeout_s)
        else:
            self.actors = [self._replica_actor(rcfg, per_replica, timeout_s) for rcfg in rcfgs]
            self.replica_addresses = ray.get([a.start.remote() for a in self.actors],
                                             timeout=timeout_s)
        if cfg.metrics_port is not None:
            if cfg.executor == "cost-model":
                found = [addr for host in ray.get([a.metrics_addresses.remote() for a in self.actors],
                                                  timeout=timeout_s) for addr in host]
            else:
                found = ray.get([a.metrics_address.remote() for a in self.actors], timeout=timeout_s)
            for i, address in enumerate(found):
                self.metrics_addresses[f"replica-{i}"] = address
        self.router_address = self._start_router(timeout_s)
        return self.router_address

    def _replica_actor(self, rcfg: ReplicaConfig, num_cpus: float, timeout_s: float):
        """Rank 0 of one replica as a Ray actor; with tp > 1 in bundle 0 of a new STRICT_PACK
        placement group holding one bundle per rank (ranks 1..T-1 take the others)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvfleet.worker.ray_actor import ReplicaActor

        tp = rcfg.tensor_parallel_size
        if tp == 1:
            return ray.remote(num_cpus=num_cpus, max_restarts=0,
                              scheduling_strategy=SPREAD)(ReplicaActor).remote(rcfg)
        cuda = rcfg.device.startswith("cuda")
        if cuda and ray.cluster_resources().get("GPU", 0) < tp:
            raise ValueError(f"--tp {tp} --device cuda: a replica needs {tp} GPUs on one node, "
                             f"the Ray cluster has {ray.cluster_resources().get('GPU', 0):g}")
        gpu = {"GPU": 1} if cuda else {}
        rest = gpu or {"CPU": rcfg.tp.rank_num_cpus}
        # The replica's CPU share covers all its ranks (tp=4 must still place on 2 cores).
        first = {"CPU": max(num_cpus - (tp - 1) * rest.get("CPU", 0), 0.01), **gpu}
        pg = placement_group([first] + [rest] * (tp - 1), strategy="STRICT_PACK")
        self.placement_groups.append(pg)
        wait_placed(pg, f"replica {rcfg.replica_id}: bundles {[first] + [rest] * (tp - 1)}", timeout_s)
        return ray.remote(ReplicaActor).options(
            num_cpus=first["CPU"], num_gpus=1 if cuda else 0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            runtime_env={"env_vars": {"OMP_WAIT_POLICY": "passive"}}).remote(rcfg)

    def _start_hosts(self, rcfgs: list[ReplicaConfig], num_cpus: float, timeout_s: float) -> None:
        """Cost-model replicas, ``replicas_per_host`` to a process (one Ray actor each)."""
        import ray

        from kvfleet.worker.replica_host import ReplicaHostActor

        host_cls = ray.remote(num_cpus=num_cpus, max_restarts=0,
                              scheduling_strategy=SPREAD)(ReplicaHostActor)
        per = max(1, self.cfg.replicas_per_host)
        self.actors = [host_cls.remote(rcfgs[i:i + per]) for i in range(0, len(rcfgs), per)]
        hosts = ray.get([a.start.remote() for a in self.actors], timeout=timeout_s)
        self.replica_addresses = [addr for host in hosts for addr in host]

    def _start_router(self, timeout_s: float) -> str:
        cfg = self.cfg
        http_port = metrics_port = None
        if cfg.http_port is not None:
            http_port = cfg.http_port or free_port(cfg.host)
            self.http_address = f"{cfg.host}:{http_port}"
        if cfg.metrics_port is not None:
            metrics_port = self._metrics_port(0) or free_port(cfg.host)
            self.metrics_addresses["router"] = f"{cfg.host}:{metrics_port}"
        cmd = [sys.executable, "-m", "kvfleet.router.main",
               *router_args(cfg, self.redis_url, http_port, metrics_port)]
        # The router reads OTEL_* at start-up: give it exactly this cluster's settings.
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(cfg.telemetry.to_env())
        self.router_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        return wait_ready(self.router_proc, "router ready ", timeout_s)

    def _metrics_port(self, offset: int) -> Optional[int]:
        port = self.cfg.metrics_port
        return None if port is None else (port + offset if port else 0)

    def stop(self) -> None:
        """Stop router, replicas, Ray (if started here) and Redis (if started here). Idempotent."""
        if self.router_proc is not None:
            self.router_proc.terminate()
            try:
                self.router_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.router_proc.kill()
                self.router_proc.wait()
            self.router_proc = None
        if self.actors:
            import ray

            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=30)
            except Exception as exc:
                log.warning("replica stop failed: %s", exc)
            for a in self.actors:
                ray.kill(a, no_restart=True)
            self.actors = []
        if self.placement_groups:
            from ray.util.placement_group import remove_placement_group

            for pg in self.placement_groups:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            self.placement_groups = []
        if self._started_ray:
            shutdown_ray()
            self._started_ray = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def router_args(cfg: ClusterConfig, redis_url: str, http_port: Optional[int] = None,
                metrics_port: Optional[int] = None) -> list[str]:
    """The router's command-line arguments (``python -m kvfleet.router.main ARGS``) for
    ``cfg``: what ``kvfleet up`` runs and what the Kubernetes router Deployment runs
    (kvfleet.deploy.k8s). ``http_port`` / ``metrics_port``: None = that endpoint off."""
    args = ["--redis-url", redis_url, "--model-name", cfg.model_name, "--model-dir", cfg.model_dir,
            "--block-size", str(cfg.block_size), "--kv-dtype", cfg.dtype,
            "--host", cfg.host, "--port", str(cfg.port), "--policy", cfg.policy,
            "--namespace", cfg.namespace]
    if cfg.api_keys_file:
        args += ["--api-keys", cfg.api_keys_file]
    if cfg.tls_cert:
        args += ["--tls-cert", cfg.tls_cert, "--tls-key", cfg.tls_key or ""]
    if cfg.internal_tls_dir:
        args += ["--internal-tls-dir", cfg.internal_tls_dir]
    args += list(cfg.router_args)
    if http_port is not None:
        args += ["--http-port", str(http_port)]
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    return args


def wait_ready(proc: subprocess.Popen, marker: str, timeout_s: float,
               sink: Optional[TextIO] = None) -> str:
    """Wait for the line starting with ``marker`` on ``proc``'s stdout (a text pipe) and return
    its last word; every other line, before and after, is copied to ``sink`` (default: this
    process's stdout) by a daemon thread. The pipe must be drained for the process's whole
    life: a child that prints to it (e.g. ``OTEL_TRACES_EXPORTER=console``) would otherwise
    block once the pipe's buffer (64 KiB) is full.

    Raises RuntimeError if the process exits first, TimeoutError after ``timeout_s`` seconds.
    """
    found: queue.Queue[str] = queue.Queue()

    def relay() -> None:
        out = sink or sys.stdout
        with contextlib.suppress(ValueError, OSError):  # pipe or sink closed at shutdown
            for line in proc.stdout:
                if found.empty() and line.startswith(marker):
                    found.put(line.split()[-1])
                    continue
                out.write(line)
                out.flush()
        found.put("")  # EOF: the process closed its stdout

    threading.Thread(target=relay, name=f"relay-{proc.pid}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            address = found.get(timeout=0.2)
            if address:
                return address
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            how = ("still runs" if proc.returncode is None
                   else f"exited with code {proc.returncode}")
            raise RuntimeError(f"{marker.strip()!r} never came: the process closed its stdout "
                               f"and {how} (see its error above)")
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before "
                               f"{marker.strip()!r} (see its error above)")
    raise TimeoutError(f"no {marker.strip()!r} within {timeout_s} s")
