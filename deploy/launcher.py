"""Local cluster launcher: a private redis-server (unless given), a local Ray (or an existing
one; kvfleet.deploy.ray_local), the model's worker replicas as a Ray Serve application
(:func:`~kvfleet.deploy.cluster_config.serve_application`) and the router as its own process
(:func:`~kvfleet.deploy.cluster_config.router_args`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Optional

from kvfleet.cpus import whole_cpus
from kvfleet.deploy import serve_control
from kvfleet.deploy.cluster_config import (
    ClusterConfig,
    router_args,
    router_env,
    serve_application,
    serve_hosts,
)
from kvfleet.deploy.operate import AppRef
from kvfleet.deploy.process_relay import wait_ready
from kvfleet.deploy.ray_local import check_port_free, free_port, init_ray, shutdown_ray
from kvfleet.deploy.redis_server import RedisServer, start_redis
from kvfleet.index_keys import ReplicaInfo
from kvfleet.tls import FILES as TLS_FILES
from kvfleet.tls_ca import renew_internal_tls

log = logging.getLogger(__name__)
MIN_REPLICA_CPUS = 0.05  # the smallest share a replica is given (the rest of a tiny Ray)


def replica_threads(host_cpus: int, cfg: ClusterConfig) -> int:
    """Torch threads for each local replica (each TP rank): ``host_cpus`` whole CPUs less
    ``cfg.reserved_cpus`` for the router and the relay, shared out over ``cfg.replicas``, at
    least 1."""
    return max(1, (host_cpus - cfg.reserved_cpus) // cfg.replicas)


def replica_cpus(cfg: ClusterConfig, free: dict, strict: bool = True) -> float:
    """Ray CPUs per Serve replica: ``cfg.replica_num_cpus``, else the free CPUs shared out
    (at most 1 each) over twice the fleet (room to double it in place) or, autoscaled, over
    MAX Serve replicas, so every replica the policy may ask for can be placed.

    Raises:
        ValueError (``strict``; else a logged warning: a Ray cluster of its own may grow)
            when MAX replicas (``--autoscale``, or the fleet) cannot be placed on ``free``
            (Ray's available resources), naming what they need and what there is.
    """
    hosts = serve_hosts(cfg)
    room = max(2 * hosts, cfg.autoscale.targets.max_replicas if cfg.autoscale else 0)
    cpus = float(free.get("CPU", 0.0))
    per = max(MIN_REPLICA_CPUS, min(1.0, cpus / room))
    if cfg.replica_num_cpus is not None:
        per = cfg.replica_num_cpus
    most = cfg.autoscale.targets.max_replicas if cfg.autoscale else hosts
    what = f"--autoscale MAX {most}" if cfg.autoscale else f"{most} Serve replica(s)"
    tp = cfg.replica.tensor_parallel_size
    gpus = float(free.get("GPU", 0.0))
    problem = None
    if per * most > cpus + 1e-9:
        problem = (f"{what} need {per * most:g} Ray CPUs ({per:g} each), the Ray cluster has "
                   f"{cpus:g} free")
    elif cfg.replica.device.startswith("cuda") and most * tp > gpus:
        problem = f"{what} need {most * tp} GPUs ({tp} each), the Ray cluster has {gpus:g} free"
    if problem is not None:
        if strict:
            raise ValueError(f"{problem}: lower MAX or give Ray more resources (a replica that "
                             f"cannot be placed stays 'starting')")
        log.warning("%s: the cluster must grow to place them", problem)
    return per


class LocalCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.redis: Optional[RedisServer] = None
        self.redis_url: Optional[str] = cfg.replica.redis_url
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
        check_port_free(cfg.router.host, cfg.router.port)
        if self.redis_url is None:
            self.redis = start_redis()
            self.redis_url = self.redis.url
        self._started_ray = not ray.is_initialized() and not cfg.ray_address
        # A console exporter prints the replicas' spans on their stdout: show them here.
        init_ray(cfg.ray_address, cfg.ray_num_cpus,
                 log_to_driver=cfg.replica.telemetry.exports_to_stdout)
        tls_dir = cfg.replica.internal_tls_dir
        if tls_dir and not all(os.path.exists(os.path.join(tls_dir, f)) for f in TLS_FILES):
            # Creates a CA in an empty directory; one issued before a file existed (the
            # replica certificate) keeps its CA and gains the missing files.
            renew_internal_tls(tls_dir)
        self.app = self._app_config()
        self.app_name = self.app["name"]
        self.ref = AppRef.from_config(self.app_name, self.app)
        serve_control.apply(self.app)
        # The router starts beside the replicas (it finds them in the registry as they
        # register), so its start-up overlaps theirs.
        self._launch_router()
        self.wait_serving(cfg.replicas, timeout_s)
        assert self.router_proc is not None
        self.router_address = wait_ready(self.router_proc, "router ready ", timeout_s)
        return self.router_address

    def _app_config(self) -> dict:
        """The model's Serve application (:func:`serve_application`), its CPU share and
        threads sized to the Ray cluster it runs on and to this host."""
        import ray

        cfg = self.cfg
        tp = cfg.replica.tensor_parallel_size
        if cfg.replica.device.startswith("cuda") and ray.cluster_resources().get("GPU", 0) < tp:
            raise ValueError(f"--tp {tp} --device cuda: a replica needs {tp} GPUs on one node, "
                             f"the Ray cluster has {ray.cluster_resources().get('GPU', 0):g}")
        # A cluster joined by address may grow (an autoscaler): warn there, refuse here.
        per_replica = replica_cpus(cfg, ray.available_resources(), strict=not cfg.ray_address)
        threads = replica_threads(whole_cpus(), cfg)
        assert self.redis_url is not None  # set by _start first
        return serve_application(cfg, self.redis_url, per_replica, threads)

    def _app(self) -> AppRef:
        """The applied application. Raises RuntimeError before :meth:`start`."""
        if self.ref is None:
            raise RuntimeError("the cluster is not started")
        return self.ref

    def registered(self) -> list[ReplicaInfo]:
        """This application's replicas in the registry (see ``AppRef.registered``)."""
        return self._app().registered()

    def wait_serving(self, replicas: int, timeout_s: float = 300.0) -> list[ReplicaInfo]:
        """Wait until exactly ``replicas`` replicas serve (``AppRef.wait_serving``, which
        says what it raises); fills ``replica_addresses`` and ``metrics_addresses``."""
        serving = self._app().wait_serving(replicas, timeout_s)
        self.replica_addresses = [i.address for i in serving]
        self.metrics_addresses = {k: v for k, v in self.metrics_addresses.items() if k == "router"}
        if self.cfg.metrics_port is not None:
            for n, info in enumerate(serving):
                self.metrics_addresses[f"replica-{n}"] = info.metrics_address
        return serving

    def scale(self, replicas: int, timeout_s: float = 300.0) -> list[ReplicaInfo]:
        """Change the replica count in place (new ones register; Serve picks the ones that
        go, and each drains first); returns once exactly ``replicas`` serve."""
        self.app = self._app().scale(replicas)
        return self.wait_serving(replicas, timeout_s)

    def upgrade(self, revision: str, model_dir: Optional[str] = None,
                timeout_s: float = 600.0) -> list[ReplicaInfo]:
        """Rolling replacement of every replica under a new ``revision`` (and ``model_dir``),
        as ``kvfleet upgrade`` does (``AppRef.upgrade``, which says what it raises)."""
        ref = self._app()
        serving = ref.upgrade(revision, model_dir, timeout_s)
        self.app = serve_control.app_configs()[ref.name]
        return self.wait_serving(len(serving), timeout_s)

    def serve_replicas(self) -> list[dict]:
        """Serve's view of this application's replicas (see ``serve_control.serve_replicas``)."""
        return serve_control.serve_replicas(self._app().name)

    def replica_pids(self) -> list[int]:
        """Process ids of the running Serve replicas (rank 0 of each)."""
        return [r["pid"] for r in self.serve_replicas() if r["state"] == "RUNNING"]

    def _launch_router(self) -> None:
        """Start the router process (its readiness is awaited by :meth:`_start`)."""
        cfg = self.cfg
        host = cfg.router.host
        http_port = metrics_port = None
        if cfg.router.http_port is not None:
            http_port = cfg.router.http_port or free_port(host)
            self.http_address = f"{host}:{http_port}"
        if cfg.metrics_port is not None:
            metrics_port = cfg.metrics_port or free_port(host)
            self.metrics_addresses["router"] = f"{host}:{metrics_port}"
        assert self.redis_url is not None  # set by _start before the router starts
        router = cfg.router_config(self.redis_url, http_port, metrics_port)
        cmd = [sys.executable, "-m", "kvfleet.router.main", *router_args(router)]
        # The router reads OTEL_* and the Redis password from its environment at start-up.
        env = router_env(router, dict(os.environ))
        self.router_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

    def stop(self) -> None:
        """Drain and stop the replicas (Serve stops each gracefully, which drains it, while the
        router still relays their streams), then the router, Ray (if started here) and Redis
        (if started here). Idempotent."""
        if self.app_name is not None:
            try:
                serve_control.delete(self.app_name,
                                     timeout_s=self.cfg.replica.drain_timeout_s + 60.0)
            except Exception as exc:
                log.warning("stopping Serve application %s failed: %s", self.app_name, exc)
            self.app_name = None
            self._remove_tiers()
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

    def _remove_tiers(self) -> None:
        """The deployment's node tiers go with it (detached actors outlive their replicas,
        and a Ray cluster this did not start outlives the deployment)."""
        from kvfleet.worker.kv_tier.node_tier import remove_node_tiers

        if not self.cfg.replica.kv_host_memory_bytes:
            return
        try:
            removed = remove_node_tiers(self.cfg.replica.namespace)
        except Exception as exc:  # Ray already gone: so are its actors
            log.warning("removing the node KV tiers failed: %s", exc)
            return
        if removed:
            log.info("removed %d node KV tier(s) of namespace %s", removed,
                     self.cfg.replica.namespace)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
