"""Local cluster launcher: a private redis-server (unless given), a local Ray (or an existing
one), the model's worker replicas as a Ray Serve application (kvfleet.deploy.serve_app) and
the router as its own process.

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
from dataclasses import dataclass, field, replace
from typing import Optional, TextIO

from kvfleet.deploy import serve_control
from kvfleet.deploy.operate import AppRef
from kvfleet.deploy.redis_server import RedisServer, start_redis
from kvfleet.deploy.serve_app import Placement, app_config
from kvfleet.worker.engine.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModel
from kvfleet.worker.executor.tp.group import TPSettings
from kvfleet.worker.replica.replica import EXECUTORS, ReplicaConfig

from kvfleet.index_keys import DEFAULT_NAMESPACE, ReplicaInfo
from kvfleet.telemetry import TelemetryConfig
from kvfleet.tls import FILES as TLS_FILES
from kvfleet.tls import generate_internal_tls

log = logging.getLogger(__name__)

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep Ray's listeners on loopback
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_DEDUP_LOGS": "0",
}
RAY_OBJECT_STORE_BYTES = 512 << 20


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
    host: str = "127.0.0.1"  # the router's
    port: int = 50051
    # Where replicas serve gRPC: 0.0.0.0 on a multi-host cluster (each advertises its node's
    # address in the registry), loopback on one host.
    replica_host: str = "127.0.0.1"
    http_port: Optional[int] = None  # the router's OpenAI-compatible HTTP front (0: a free port)
    redis_url: Optional[str] = None
    ray_address: Optional[str] = None
    namespace: str = DEFAULT_NAMESPACE
    api_keys_file: Optional[str] = None
    ray_num_cpus: Optional[int] = None
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # OTLP export settings
    # Prometheus: the router on metrics_port, replica i on metrics_port + 1 + i (0: free ports).
    metrics_port: Optional[int] = None
    # CPUs each replica reserves in Ray (default: half the free CPUs shared out, at most 1;
    # 0 lets a second cluster share a Ray whose CPUs another one holds, as tests do).
    replica_num_cpus: Optional[float] = None
    # "cost-model": replicas whose forward is the cost model (kvfleet.worker.executor.cost_model),
    # up to replicas_per_host of them sharing one process (Ray actor).
    executor: str = "model"
    cost_model: Optional[CostModel] = None
    replicas_per_host: int = 64
    router_args: tuple[str, ...] = ()  # extra router command-line arguments (policy knobs)
    # Ranks per replica: rank 0 is the Serve replica, ranks 1..T-1 Ray actors in its
    # placement group (one bundle per rank, STRICT_PACK).
    tensor_parallel_size: int = 1
    tp: TPSettings = field(default_factory=TPSettings)
    device: str = "cpu"
    tls_cert: Optional[str] = None  # PEM files: the router's client port over TLS
    tls_key: Optional[str] = None
    # Mutual TLS router <-> workers with this directory's cluster CA (kvfleet.tls); generated
    # there when it holds no certificates yet.
    internal_tls_dir: Optional[str] = None
    # LoRA (see ReplicaConfig): (name, directory) pairs every replica serves, slots, top rank.
    adapters: tuple[tuple[str, str], ...] = ()
    adapter_roots: tuple[str, ...] = ()  # where a runtime LoadAdapter may read (ReplicaConfig)
    max_loras: int = 4
    max_lora_rank: int = 64
    # Lifecycle (kvfleet.deploy.serve_app): a drain waits this long for in-flight streams;
    # the revision labels a rollout (a new one replaces every replica, one at a time).
    drain_timeout_s: float = 30.0
    revision: str = ""
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 10.0

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
        self.app: dict = {}  # the applied Serve application config
        self.app_name: Optional[str] = None  # set once the application was applied
        self.ref: Optional[AppRef] = None
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
        self.app = self._app_config()
        self.app_name = self.app["name"]
        self.ref = AppRef.from_config(self.app_name, self.app)
        serve_control.apply(self.app)
        self.wait_serving(cfg.replicas, timeout_s)
        self.router_address = self._start_router(timeout_s)
        return self.router_address

    def _app_config(self) -> dict:
        """The model's Serve application (:func:`serve_application`), its CPU share and
        threads sized to the Ray cluster it runs on and to this host."""
        import ray

        cfg = self.cfg
        tp = cfg.tensor_parallel_size
        if cfg.device.startswith("cuda") and ray.cluster_resources().get("GPU", 0) < tp:
            raise ValueError(f"--tp {tp} --device cuda: a replica needs {tp} GPUs on one node, "
                             f"the Ray cluster has {ray.cluster_resources().get('GPU', 0):g}")
        hosts = -(-cfg.replicas // replicas_per_process(cfg))
        cpus = float(ray.available_resources().get("CPU", 1.0))
        # Half the free CPUs shared out (at most 1 each): room to scale the fleet to twice
        # its size in place.
        per_replica = max(0.05, min(1.0, cpus / (2 * hosts)))
        if cfg.replica_num_cpus is not None:
            per_replica = cfg.replica_num_cpus
        threads = max(1, (os.cpu_count() or 1) // cfg.replicas)
        return serve_application(cfg, self.redis_url, per_replica, threads)

    def registered(self) -> list[ReplicaInfo]:
        """This application's replicas in the registry (see ``AppRef.registered``)."""
        return self.ref.registered()

    def wait_serving(self, replicas: int, timeout_s: float = 300.0) -> list[ReplicaInfo]:
        """Wait until exactly ``replicas`` replicas serve (``AppRef.wait_serving``, which
        says what it raises); fills ``replica_addresses`` and ``metrics_addresses``."""
        serving = self.ref.wait_serving(replicas, timeout_s)
        self.replica_addresses = [i.address for i in serving]
        self.metrics_addresses = {k: v for k, v in self.metrics_addresses.items() if k == "router"}
        if self.cfg.metrics_port is not None:
            for n, info in enumerate(serving):
                self.metrics_addresses[f"replica-{n}"] = info.metrics_address
        return serving

    def scale(self, replicas: int, timeout_s: float = 300.0) -> list[ReplicaInfo]:
        """Change the replica count in place (new ones register; Serve picks the ones that
        go, and each drains first); returns once exactly ``replicas`` serve."""
        self.app = self.ref.scale(replicas)
        return self.wait_serving(replicas, timeout_s)

    def upgrade(self, revision: str, model_dir: Optional[str] = None,
                timeout_s: float = 600.0) -> list[ReplicaInfo]:
        """Rolling replacement of every replica under a new ``revision`` (and ``model_dir``),
        as ``kvfleet upgrade`` does (``AppRef.upgrade``, which says what it raises)."""
        serving = self.ref.upgrade(revision, model_dir, timeout_s)
        self.app = serve_control.app_configs()[self.app_name]
        return self.wait_serving(len(serving), timeout_s)

    def serve_replicas(self) -> list[dict]:
        """Serve's view of this application's replicas (see ``serve_control.serve_replicas``)."""
        return serve_control.serve_replicas(self.app_name)

    def replica_pids(self) -> list[int]:
        """Process ids of the running Serve replicas (rank 0 of each)."""
        return [r["pid"] for r in self.serve_replicas() if r["state"] == "RUNNING"]

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
        """Drain and stop the replicas (Serve stops each gracefully, which drains it, while the
        router still relays their streams), then the router, Ray (if started here) and Redis
        (if started here). Idempotent."""
        if self.app_name is not None:
            try:
                serve_control.delete(self.app_name,
                                     timeout_s=self.cfg.drain_timeout_s + 60.0)
            except Exception as exc:
                log.warning("stopping Serve application %s failed: %s", self.app_name, exc)
            self.app_name = None
        if self.router_proc is not None:
            self.router_proc.terminate()
            try:
                self.router_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.router_proc.kill()
                self.router_proc.wait()
            self.router_proc = None
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


def replicas_per_process(cfg: ClusterConfig) -> int:
    """kvfleet replicas one Serve replica hosts: many cost-model ones, else 1."""
    return max(1, cfg.replicas_per_host) if cfg.executor == "cost-model" else 1


def serve_application(cfg: ClusterConfig, redis_url: str, num_cpus: float, threads: int) -> dict:
    """The Serve application config (``ServeApplicationSchema`` fields,
    kvfleet.deploy.serve_app) that runs ``cfg``'s replicas: what ``kvfleet up`` applies, and
    what the Kubernetes RayService's ``serveConfigV2`` holds (kvfleet.deploy.k8s), so the two
    cannot drift. ``num_cpus``: Ray CPUs per Serve replica (rank 0 and, at tp > 1, a share
    for the other ranks); ``threads``: torch threads per rank.

    Raises ValueError for a config a replica refuses (see ReplicaConfig)."""
    tp = cfg.tensor_parallel_size
    metrics = None if cfg.metrics_port is None else 0  # many replicas: free ports
    base = ReplicaConfig(
        replica_id=cfg.model_name, model_name=cfg.model_name, model_dir=cfg.model_dir,
        block_size=cfg.block_size, num_blocks=cfg.num_blocks,
        kv_memory_bytes=cfg.kv_memory_bytes, dtype=cfg.dtype,
        one_row_weights=cfg.one_row_weights, scheduler=cfg.scheduler,
        redis_url=redis_url, namespace=cfg.namespace, host=cfg.replica_host,
        num_threads=threads, telemetry=replace(cfg.telemetry, metrics_port=metrics),
        executor=cfg.executor, cost_model=cfg.cost_model,
        tensor_parallel_size=tp, tp=cfg.tp, device=cfg.device,
        internal_tls_dir=cfg.internal_tls_dir, drain_timeout_s=cfg.drain_timeout_s,
        adapters=cfg.adapters, adapter_roots=cfg.adapter_roots, max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank)
    placement = Placement(num_cpus, tp, cfg.device.startswith("cuda"), cfg.tp.rank_num_cpus)
    env = {**RAY_ENV, "OMP_WAIT_POLICY": "passive"}
    return app_config(base, cfg.replicas, placement, replicas_per_process(cfg), cfg.revision,
                      env, cfg.health_check_period_s, cfg.health_check_timeout_s)


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
