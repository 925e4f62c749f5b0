"""Driver side of kvfleet on Ray Serve: start Serve (its proxy off), apply, scale and delete
a model's worker application through the declarative config, the way ``serve deploy``
applies one, and read Serve's view of its replicas.

Why declarative: on Ray 2.60 a ``serve.run(….options(num_replicas=n).bind())`` redeploy
restarted every replica (every prefix cache lost), while a config update that changes only
``num_replicas`` keeps the running ones (``shared/ENVIRONMENT.md``). A config whose ``args``
change (a new revision, a new model directory) is a rolling replacement, one replica at a time.

One application per served model and kvfleet namespace, named :func:`app_name`; its ``args``
carry the replica config (Redis URL and namespace included), so any driver attached to the
Ray cluster finds a cluster's applications from Serve alone (:func:`find_apps`). Serve's
declarative apply replaces the whole set of applications, so every apply here merges into
the applications already deployed.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from typing import Optional

log = logging.getLogger(__name__)

IMPORT_PATH = "kvfleet.deploy.serve_app:build"
SERVE_NAMESPACE = "serve"  # the Ray namespace of Serve's controller and replicas
DEPLOYMENT = "KvfleetReplica"


def app_name(namespace: str, model: str) -> str:
    """``kvfleet.tiny-llama`` for namespace ``kvfleet:`` and model ``tiny-llama`` (Serve puts
    the name in log file paths: no ``/``)."""
    stem = namespace.rstrip(":") or "kvfleet"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", f"{stem}.{model}")


def client():
    """Serve's controller client, starting Serve (no proxy) on the connected Ray if needed."""
    from ray import serve
    from ray.serve.context import _get_global_client

    found = _get_global_client(raise_if_no_controller_running=False)
    if found is not None:
        return found
    serve.start(proxy_location="Disabled")
    return _get_global_client()


def app_configs() -> dict[str, dict]:
    """Every application Serve holds a declarative config for: name → config dict."""
    import ray

    ctl = client()._controller
    return {name: schema.model_dump(exclude_unset=True)
            for name, schema in ray.get(ctl.get_app_configs.remote()).items()}


def deploy_config(apps: list[dict]) -> dict:
    """The whole Serve config (``ServeDeploySchema`` fields) holding application configs
    ``apps``, Serve's proxy off (kvfleet's router is the data plane): what this module
    applies, what ``serve deploy`` / ``serve run`` take, and what a KubeRay RayService's
    ``serveConfigV2`` holds."""
    return {"proxy_location": "Disabled", "applications": list(apps)}


def apply(app: dict) -> None:
    """Deploy or update one application config (a dict of ``ServeApplicationSchema``
    fields), keeping every other application as it is. Raises whatever Serve's schema
    validation raises for a bad config (pydantic ValidationError: a ValueError)."""
    from ray.serve.schema import ServeDeploySchema

    apps = app_configs()
    apps[app["name"]] = app
    schema = ServeDeploySchema.model_validate(deploy_config(list(apps.values())))
    client().deploy_apps(schema)


def delete(name: str, timeout_s: float = 120.0) -> None:
    """Delete one application (Serve stops its replicas gracefully: each drains) and wait
    until every replica process has exited (the application leaves Serve's status earlier,
    while its replicas may still drain).

    Raises TimeoutError when they have not gone within ``timeout_s`` seconds."""
    from ray.serve.schema import ServeDeploySchema

    apps = app_configs()
    if apps.pop(name, None) is None:
        return
    actors = [r["actor_name"] for r in serve_replicas(name) if r.get("actor_name")]
    client().deploy_apps(ServeDeploySchema.model_validate(deploy_config(list(apps.values()))))
    deadline = time.monotonic() + timeout_s
    while name in app_statuses() or any(_actor_alive(a) for a in actors):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve application {name!r} still runs after {timeout_s:g} s")
        time.sleep(0.2)


def _actor_alive(actor_name: str) -> bool:
    import ray

    try:
        ray.get_actor(actor_name, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:  # no such actor (any more)
        return False


def set_replicas(name: str, num_replicas: int) -> dict:
    """Change only ``num_replicas`` of application ``name`` (a lightweight update: running
    replicas stay; Serve picks which ones stop, and each drains first). Returns the applied
    config. Raises KeyError naming the application when Serve holds no config for it, and
    ValueError for ``num_replicas`` < 1."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    app = copy.deepcopy(app_configs().get(name) or _missing(name))
    app["deployments"][0]["num_replicas"] = num_replicas
    apply(app)
    return app


def set_revision(name: str, revision: str, model_dir: Optional[str] = None) -> dict:
    """Roll application ``name`` to a new ``revision`` label (and ``model_dir``, if given):
    new ``args`` make Serve replace every replica, starting each new one before an old one
    stops (``max_surge_percent``). Returns the applied config. Raises KeyError as
    :func:`set_replicas` does."""
    app = copy.deepcopy(app_configs().get(name) or _missing(name))
    app["args"]["revision"] = revision
    if model_dir is not None:
        app["args"]["replica"]["model_dir"] = model_dir
    apply(app)
    return app


def _missing(name: str):
    raise KeyError(f"no kvfleet application {name!r} in this Ray cluster's Serve "
                   f"(found: {sorted(app_configs())})")


def app_statuses() -> dict[str, str]:
    """Application name → Serve status (``DEPLOYING``, ``RUNNING``, ``UNHEALTHY``, …)."""
    details = client().get_serve_details()
    return {name: str(app["status"]).rsplit(".", 1)[-1]
            for name, app in details.get("applications", {}).items()}


def app_message(name: str) -> str:
    """Serve's message about application ``name`` and its deployments ("" when none)."""
    app = client().get_serve_details().get("applications", {}).get(name) or {}
    parts = [app.get("message") or ""]
    parts += [d.get("message") or "" for d in app.get("deployments", {}).values()]
    return "; ".join(p for p in parts if p)


def target_replicas(name: str) -> Optional[int]:
    """The replica count Serve is moving application ``name``'s deployment to (an autoscaled
    one's current target), or None when Serve does not know the application."""
    app = client().get_serve_details().get("applications", {}).get(name) or {}
    for dep in app.get("deployments", {}).values():
        return int(dep.get("target_num_replicas", 0))
    return None


def serve_replicas(name: str) -> list[dict]:
    """Serve's replicas of application ``name``: dicts with ``replica_id``, ``state``
    (``STARTING``, ``RUNNING``, ``STOPPING``, ``RECOVERING``, …), ``pid``, ``node_id``,
    ``node_ip``, ``start_time_s``, ``actor_name``; [] when the application is unknown."""
    app = client().get_serve_details().get("applications", {}).get(name)
    if app is None:
        return []
    out = []
    for dep in app.get("deployments", {}).values():
        for r in dep.get("replicas", []):
            out.append({k: r.get(k) for k in ("replica_id", "state", "pid", "node_id",
                                              "node_ip", "start_time_s", "actor_name")})
    return out


def find_apps(namespace: Optional[str] = None, model: Optional[str] = None) -> dict[str, dict]:
    """The kvfleet applications (by their import path) of ``namespace`` and ``model``
    (None: any): name → config."""
    found = {}
    for name, app in app_configs().items():
        if app.get("import_path") != IMPORT_PATH:
            continue
        replica = app.get("args", {}).get("replica", {})
        if namespace is not None and replica.get("namespace") != namespace:
            continue
        if model is not None and replica.get("model_name") != model:
            continue
        found[name] = app
    return found
