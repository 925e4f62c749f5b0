"""Operating a running cluster from any terminal: ``kvfleet scale``, ``upgrade`` and ``status``.

A cluster is found through Ray: ``--address`` (the Ray GCS address ``kvfleet up`` prints),
else the cluster file ``kvfleet up`` writes (:func:`cluster_file`). Serve's application configs
then name everything else (model, Redis URL, kvfleet namespace; :mod:`.serve_control`).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvfleet.allocator.units import cdiv
from kvfleet.deploy import serve_control
from kvfleet.deploy.ray_local import init_ray
from kvfleet.deploy.registry_view import read_registry, read_routers
from kvfleet.deploy.status import replica_rows
from kvfleet.index_keys import ReplicaInfo, redis_host
from kvfleet.secrets import REDIS_PASSWORD_ENV, with_redis_password
from kvfleet.tls import expiry_report


def cluster_file() -> Path:
    """Where ``kvfleet up`` records its cluster for other terminals (per user, under TMPDIR)."""
    return Path(tempfile.gettempdir()) / f"kvfleet-{os.getuid()}" / "cluster.json"


def write_cluster_file(record: dict) -> Path:
    path = cluster_file()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return path


def remove_cluster_file(pid: int) -> None:
    """Remove the cluster file if it is the one process ``pid`` wrote."""
    path = cluster_file()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def ray_address(address: Optional[str]) -> str:
    """``address``, else the one in the cluster file. Raises ValueError saying what to pass."""
    if address:
        return address
    try:
        return json.loads(cluster_file().read_text())["ray_address"]
    except (OSError, ValueError, KeyError):
        raise ValueError(f"no running kvfleet cluster found ({cluster_file()} is missing): "
                         f"pass --address with the Ray address `kvfleet up` printed") from None


def _probe_gcs(target: str, timeout_s: float = 3.0) -> None:
    """Raise ConnectionError at once when nothing listens at ``target`` (``HOST:PORT``; other
    forms are left to Ray): Ray itself retries a dead address for minutes (a stale cluster
    file, a mistyped ``--address``)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "://" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"cannot reach Ray at {target}: {exc} (is the cluster up? "
                              f"`kvfleet up` prints its Ray address)") from exc


def connect(address: Optional[str]) -> None:
    """Attach this process to the cluster's Ray as a driver. Raises ValueError (see
    :func:`ray_address`) or ConnectionError when Ray does not answer there."""
    target = ray_address(address)
    _probe_gcs(target)
    try:
        init_ray(target)
    except Exception as exc:  # Ray raises ConnectionError or RuntimeError, by version
        raise ConnectionError(f"cannot reach Ray at {target}: {exc}") from exc


@dataclass(frozen=True)
class AppRef:
    """One model's Serve application and where its replicas register."""

    name: str
    model: str
    namespace: str
    redis_url: str
    per_host: int = 1
    tp: int = 1

    @classmethod
    def from_config(cls, name: str, app: dict) -> "AppRef":
        """From a Serve application config. The Redis password (never in the args) comes from
        this process's ``KVFLEET_REDIS_PASSWORD``, else the application's own environment."""
        replica = app["args"]["replica"]
        env = {**app.get("runtime_env", {}).get("env_vars", {}), **os.environ}
        return cls(name, replica["model_name"], replica["namespace"],
                   with_redis_password(replica["redis_url"], env.get(REDIS_PASSWORD_ENV)),
                   int(app["args"].get("count", 1)), int(replica.get("tensor_parallel_size", 1)))

    def registered(self) -> list[ReplicaInfo]:
        """This application's registry entries (serving or draining) hosted by one of Serve's
        current replicas (a killed one's entry lingers until its heartbeat TTL)."""
        hosts = {r["replica_id"] for r in serve_control.serve_replicas(self.name)}
        return [e.info for e in read_registry(self.redis_url, self.namespace)
                if e.info.model == self.model and e.info.serve_replica in hosts]

    def wait_serving(self, replicas: int, timeout_s: float = 300.0,
                     replacing: frozenset[str] = frozenset()) -> list[ReplicaInfo]:
        """Wait until exactly ``replicas`` replicas serve (registered, not draining); returns
        them by id. ``replacing``: Serve replica ids of a rollout's old replicas, which do not
        count and must all have left the registry (Serve's replica list can be briefly empty
        mid-rollout, so "none old listed" alone is not done).

        Raises:
            RuntimeError: Serve failed to deploy the application (its message included).
            TimeoutError: not within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.registered()
            serving = sorted((i for i in now
                              if i.state == "serving" and i.serve_replica not in replacing),
                             key=lambda i: i.replica_id)
            old_left = sum(i.serve_replica in replacing for i in now)
            if len(serving) == replicas and not old_left:
                return serving
            status = serve_control.app_statuses().get(self.name, "")
            # UNHEALTHY passes while Serve replaces a failed replica; a failed deploy does not.
            if status == "DEPLOY_FAILED" or time.monotonic() > deadline:
                message = serve_control.app_message(self.name)
                if status == "DEPLOY_FAILED":
                    raise RuntimeError(f"Serve application {self.name}: {status}: {message}")
                old = f", {old_left} old ones still registered" if replacing else ""
                raise TimeoutError(f"{len(serving)} of {replicas} {'new ' if replacing else ''}"
                                   f"replicas of {self.model} serving after {timeout_s:g} s{old} "
                                   f"(Serve: {status or 'no application'} {message})")
            time.sleep(0.1)

    def scale(self, replicas: int) -> dict:
        """Apply ``replicas`` kvfleet replicas (Serve replicas: ``ceil(replicas / per_host)``);
        returns the applied config. Raises ValueError for ``replicas`` < 1."""
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        return serve_control.set_replicas(self.name, cdiv(replicas, self.per_host))

    def upgrade(self, revision: str, model_dir: Optional[str] = None,
                timeout_s: float = 600.0) -> list[ReplicaInfo]:
        """Roll every replica to a new ``revision`` label (and ``model_dir``, if given) through
        an in-place config update; each new replica serves before an old one drains. Returns
        once the configured number of replicas serve, none of them an old one.

        Raises:
            ValueError: ``revision`` is empty.
            KeyError: Serve holds no config for the application.
            RuntimeError, TimeoutError: as :meth:`wait_serving`.
        """
        if not revision:
            raise ValueError("--revision must not be empty")
        old = frozenset(i.serve_replica for i in self.registered())
        app = serve_control.set_revision(self.name, revision, model_dir)
        want = int(app["deployments"][0].get("num_replicas", 1)) * self.per_host
        return self.wait_serving(want, timeout_s, replacing=old)


def find_app(namespace: Optional[str], model: Optional[str]) -> AppRef:
    """The one application matching. Raises ValueError naming what was found instead."""
    apps = serve_control.find_apps(namespace, model)
    if len(apps) != 1:
        found = sorted(apps) or sorted(serve_control.find_apps())
        what = "no" if not apps else "more than one"
        raise ValueError(f"{what} kvfleet application matches (namespace {namespace or 'any'}, "
                         f"model {model or 'any'}); found: {found or 'none'}: pass --model or "
                         f"--namespace")
    ((name, app),) = apps.items()
    return AppRef.from_config(name, app)


def node_tiers() -> list[dict]:
    """The host KV tier of every node (:func:`kvfleet.worker.kv_tier.node_tier.node_tiers`)."""
    from kvfleet.worker.kv_tier.node_tier import node_tiers as tiers

    return tiers()


def cluster_status(namespace: Optional[str], model: Optional[str] = None) -> dict:
    """Every application of one kvfleet namespace with its replicas, routers and Redis (the
    dict ``kvfleet status --json`` prints). Raises ValueError when nothing (or more than one
    namespace) matches."""
    apps = serve_control.find_apps(namespace, model)
    refs = [AppRef.from_config(n, a) for n, a in sorted(apps.items())]
    namespaces = sorted({r.namespace for r in refs})
    if len(namespaces) != 1:
        raise ValueError(f"kvfleet namespaces found: {namespaces or 'none'}: pass --namespace")
    statuses = serve_control.app_statuses()
    redis_url = refs[0].redis_url
    out: dict[str, Any] = {"namespace": namespaces[0], "applications": [], "routers": [],
           "redis": {"address": redis_host(redis_url), "up": True}}
    try:
        entries = read_registry(redis_url, namespaces[0])
        out["routers"] = read_routers(redis_url, namespaces[0])
    except Exception:  # redis-py's ConnectionError / TimeoutError: shown, not raised
        entries, out["redis"]["up"] = [], False
    for ref in refs:
        app = apps[ref.name]
        mine = [e for e in entries if e.info.model == ref.model]
        dep = app["deployments"][0]
        target = dep.get("num_replicas", 1)
        auto = None
        if dep.get("autoscaling_config"):
            target = serve_control.target_replicas(ref.name) or 0
            auto = autoscale_status(ref.name, dep["autoscaling_config"])
        out["applications"].append({
            "app": ref.name, "model": ref.model, "revision": app["args"].get("revision", ""),
            "serve_status": statuses.get(ref.name, "NOT_STARTED"),
            "target_replicas": target * ref.per_host, "autoscale": auto,
            "replicas": replica_rows(serve_control.serve_replicas(ref.name), mine, ref.tp),
            "internal_tls": internal_tls_status(app["args"]["replica"].get("internal_tls_dir"))})
    out["kv_tiers"] = node_tiers()
    return out


def autoscale_status(app_name: str, serve_autoscaling: dict) -> dict:
    """An autoscaled application's bounds and the policy's last decision (target, current,
    reason, detail, age_s; kvfleet.deploy.autoscale_serve.read_decision); ``decision`` None
    before the first one."""
    from kvfleet.deploy.autoscale_serve import read_decision

    decision = read_decision(app_name)
    if decision is not None:
        decision["age_s"] = round(max(0.0, time.time() - decision.pop("at", time.time())), 1)
    return {"min": serve_autoscaling.get("min_replicas"),
            "max": serve_autoscaling.get("max_replicas"), "decision": decision}


def internal_tls_status(directory: Optional[str]) -> Optional[dict]:
    """The replicas' internal TLS directory and days to expiry of each certificate in it, as
    this host sees it (``kvfleet.tls.expiry_report``); None when mutual TLS is off."""
    if not directory:
        return None
    return {"dir": directory, "certificates": expiry_report(directory)}
