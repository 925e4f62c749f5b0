"""What a kvfleet cluster runs, declared once: :class:`ClusterConfig` composes the replica's
and the router's own configs, and the two functions both ``kvfleet up`` and the Kubernetes
manifests use turn it into what those processes are given — :func:`serve_application` (the
replicas' Serve application) and :func:`router_args` (the router's command line).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from kvfleet.allocator.units import cdiv
from kvfleet.deploy.autoscale_serve import AutoscaleConfig
from kvfleet.deploy.ray_local import RAY_ENV
from kvfleet.deploy.serve_app import Placement, app_config
from kvfleet.router.config import RouterConfig
from kvfleet.router.flags import parse_args, router_argv
from kvfleet.secrets import (
    REDIS_PASSWORD_ENV,
    secret_env,
    split_redis_password,
    split_telemetry_secrets,
)
from kvfleet.tls import default_internal_tls_dir, needs_internal_tls
from kvfleet.worker.replica.replica import ReplicaConfig

# What the router shares with the replicas, as (RouterConfig field, ReplicaConfig field): set
# on the replica only; the router's copy is filled from it (ClusterConfig.router_config).
SHARED = (("model_name", "model_name"), ("model_dir", "model_dir"),
          ("block_size", "block_size"), ("kv_dtype", "dtype"), ("quantization", "quantization"),
          ("quant_group_size", "quant_group_size"), ("namespace", "namespace"),
          ("redis_url", "redis_url"), ("internal_tls_dir", "internal_tls_dir"),
          ("telemetry", "telemetry"))
_ROUTER_DEFAULTS = RouterConfig()


@dataclass(frozen=True)
class ClusterConfig:
    """What ``kvfleet up`` starts: ``replicas`` copies of ``replica`` behind one ``router``.

    Each setting is declared once, by the process that reads it:

    - ``replica``: every worker replica's settings. Its ``replica_id`` is the stem of the
      replicas' ids; per deployment, :func:`serve_application` sets the Redis URL, torch
      threads and Prometheus port. ``replica.redis_url`` None: a private Redis is started.
      ``replica.telemetry`` (OTLP export) is the router's too; leave its ``metrics_port``
      unset and use ``metrics_port`` here.
    - ``router``: the router's own settings; those in :data:`SHARED` (model, block size, KV
      dtype, namespace, Redis, internal TLS, telemetry) are the replica's — leave them unset.
    - the rest: how many, where (Ray), and the Serve deployment's lifecycle knobs.
      ``metrics_port``: Prometheus on the router at this port, on each replica at a free one
      (0: free ports everywhere; None: off). ``replica_num_cpus``: Ray CPUs per Serve
      replica (default: half the free CPUs shared out, at most 1; 0 lets a second cluster
      share a Ray whose CPUs another holds). ``replicas_per_host``: cost-model replicas one
      Serve replica (one process) hosts: 1, each fails (and is replaced) alone; more are
      cheaper (one torch import) but a process that dies takes all of them with it.
      ``reserved_cpus``: whole CPUs of the launching host left out of the local replicas'
      torch threads, for the router, the token relay and the OS (a thread pool that spans every
      core stalls at each barrier whenever one of them runs). ``revision`` labels a rollout.
      ``autoscale``: Serve scales the replicas between its MIN and MAX with kvfleet's policy
      (kvfleet.deploy.autoscale_serve), starting at MIN (= ``replicas``), one kvfleet replica
      per Serve replica.

    Raises:
        ValueError: ``replicas`` < 1, ``reserved_cpus`` < 0, a shared router field set unlike
            the replica's, or ``replica.telemetry.metrics_port`` set (the message names the field).
    """

    replica: ReplicaConfig
    router: RouterConfig = field(default_factory=RouterConfig)
    replicas: int = 2
    ray_address: Optional[str] = None
    ray_num_cpus: Optional[int] = None
    replica_num_cpus: Optional[float] = None
    replicas_per_host: int = 1
    reserved_cpus: int = 1
    metrics_port: Optional[int] = None
    revision: str = ""
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 10.0
    autoscale: Optional[AutoscaleConfig] = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replicas_per_host < 1:
            raise ValueError(f"replicas_per_host must be >= 1, got {self.replicas_per_host}")
        if self.reserved_cpus < 0:
            raise ValueError(f"reserved_cpus must be >= 0, got {self.reserved_cpus}")
        if self.autoscale is not None and self.replicas != self.autoscale.targets.min_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be the autoscale MIN "
                             f"({self.autoscale.targets.min_replicas}): it starts there")
        for mine, theirs in SHARED:
            value, want = getattr(self.router, mine), getattr(self.replica, theirs)
            if value != getattr(_ROUTER_DEFAULTS, mine) and value != want:
                raise ValueError(f"router.{mine} ({value!r}) differs from replica.{theirs} "
                                 f"({want!r}): the router takes the replica's; set it there")
        if self.replica.telemetry.metrics_port is not None:
            raise ValueError("replica.telemetry.metrics_port is set per replica: use "
                             "ClusterConfig.metrics_port (the router on it, replicas on free ports)")

    def router_config(self, redis_url: str, http_port: Optional[int] = None,
                      metrics_port: Optional[int] = None) -> RouterConfig:
        """The router's whole config: ``router`` with the :data:`SHARED` fields taken from
        ``replica``. ``redis_url``: the cluster's Redis (maybe started after this config was
        made); ``http_port`` / ``metrics_port``: ports the launcher resolved (None: the
        declared ``router.http_port``, and ``metrics_port`` of this config)."""
        shared = {mine: getattr(self.replica, theirs) for mine, theirs in SHARED}
        metrics = self.metrics_port if metrics_port is None else metrics_port
        shared.update(redis_url=redis_url,
                      telemetry=replace(self.replica.telemetry, metrics_port=metrics),
                      http_port=self.router.http_port if http_port is None else http_port)
        return replace(self.router, **shared)


def replicas_per_process(cfg: ClusterConfig) -> int:
    """kvfleet replicas one Serve replica hosts: ``replicas_per_host`` cost-model ones, else
    1 (and 1 when autoscaled: Serve's count is the replicas' count)."""
    if cfg.autoscale is not None or cfg.replica.executor != "cost-model":
        return 1
    return cfg.replicas_per_host


def serve_hosts(cfg: ClusterConfig) -> int:
    """Serve replicas (processes) that host ``cfg.replicas`` kvfleet replicas."""
    return cdiv(cfg.replicas, replicas_per_process(cfg))


def serve_application(cfg: ClusterConfig, redis_url: str, num_cpus: float, threads: int) -> dict:
    """The Serve application config (``ServeApplicationSchema`` fields,
    kvfleet.deploy.serve_app) that runs ``cfg``'s replicas: what ``kvfleet up`` applies, and
    what the Kubernetes RayService's ``serveConfigV2`` holds (kvfleet.deploy.k8s), so the two
    cannot drift. ``num_cpus``: Ray CPUs per Serve replica (rank 0 and, at tp > 1, a share
    for the other ranks); ``threads``: torch threads per rank.

    Raises ValueError for a config a replica refuses (see ReplicaConfig)."""
    rep = cfg.replica
    metrics = None if cfg.metrics_port is None else 0  # many replicas: free ports
    # Secrets go in the replicas' environment, never in the args Serve stores and shows.
    redis_url, password = split_redis_password(redis_url)
    telemetry, telemetry_secrets = split_telemetry_secrets(rep.telemetry)
    base = replace(rep, redis_url=redis_url, num_threads=threads,
                   telemetry=replace(telemetry, metrics_port=metrics))
    placement = Placement(num_cpus, rep.tensor_parallel_size, rep.device.startswith("cuda"),
                          rep.tp.rank_num_cpus)
    env = {**RAY_ENV, "OMP_WAIT_POLICY": "passive", **secret_env(password),
           **telemetry_secrets, **(cfg.autoscale.env() if cfg.autoscale else {})}
    return app_config(base, cfg.replicas, placement, replicas_per_process(cfg), cfg.revision,
                      env, cfg.health_check_period_s, cfg.health_check_timeout_s,
                      cfg.autoscale.serve_config() if cfg.autoscale else None)


def router_args(router: RouterConfig) -> list[str]:
    """The command line (``python -m kvfleet.router.main ARGS``) whose parse is ``router``
    (kvfleet.router.flags.router_argv): what ``kvfleet up`` runs and what the Kubernetes router
    Deployment runs (kvfleet.deploy.k8s). A password in ``redis_url`` is left out (it goes in
    the router's environment: :func:`router_env`), as are telemetry's OTLP settings.

    Raises:
        ValueError: a setting the router has no flag for, or an unknown policy option.
    """
    return router_argv(router)


def router_env(router: RouterConfig, base: dict[str, str]) -> dict[str, str]:
    """The router process's environment: ``base`` without any ``OTEL_*`` variable, then
    exactly ``router``'s telemetry settings and the Redis password of its ``redis_url``."""
    env = {k: v for k, v in base.items() if not k.startswith("OTEL_")}
    env.update(router.telemetry.to_env())
    env.pop(REDIS_PASSWORD_ENV, None)
    env.update(secret_env(split_redis_password(router.redis_url)[1]))
    return env


def with_default_internal_tls(values: dict) -> dict:
    """ReplicaConfig field ``values`` with ``internal_tls_dir`` defaulted to
    ``~/.kvfleet/internal-tls`` (kvfleet.tls.default_internal_tls_dir) when ``host`` is
    beyond loopback and none is set: replicas reachable from other hosts serve mutual TLS by
    default, never plaintext (the router follows: :data:`SHARED`)."""
    if needs_internal_tls(values.get("host") or "127.0.0.1") and not values.get("internal_tls_dir"):
        return {**values, "internal_tls_dir": str(default_internal_tls_dir())}
    return values


def router_from_flags(flags: Sequence[str]) -> RouterConfig:
    """A router config of its own settings from router flags (``("--no-index-mirror",)``,
    policy knobs), as benchmarks take them; the :data:`SHARED` fields stay unset. Raises
    SystemExit (argparse) for a flag the router does not take."""
    parsed = parse_args(["--redis-url", "", "--model-name", "", "--model-dir", "", *flags])
    return replace(parsed, **{mine: getattr(_ROUTER_DEFAULTS, mine) for mine, _ in SHARED})
