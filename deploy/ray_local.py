"""A local Ray for kvfleet's processes: started with the settings measured in ENVIRONMENT.md
(no dashboard, a 512 MiB object store, every listener on 127.0.0.1), or joined at an address;
and the loopback port checks the launcher makes before it starts children."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Optional

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep Ray's listeners on loopback
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_DEDUP_LOGS": "0",
}
RAY_OBJECT_STORE_BYTES = 512 << 20
# The local Ray's session directory when `kvfleet up`'s supervisor (deploy.own_session) made it:
# it removes it even where this process dies without stopping Ray.
RAY_TEMP_DIR_ENV = "KVFLEET_RAY_TEMP_DIR"

_ray_temp_dir: Optional[str] = None  # the session directory of a Ray that init_ray started


def init_ray(address: Optional[str] = None, num_cpus: Optional[int] = None,
             log_to_driver: bool = False) -> None:
    """Start a local Ray head with small caps, or join ``address``. Idempotent (a Ray already
    initialised keeps its settings). ``log_to_driver``: print the actors' stdout and stderr
    here too (else they stay in Ray's session logs, deleted with a Ray started here)."""
    import ray

    global _ray_temp_dir
    os.environ.update(RAY_ENV)
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return
    given = os.environ.get(RAY_TEMP_DIR_ENV)
    if given:
        os.makedirs(given, exist_ok=True)
    _ray_temp_dir = given or tempfile.mkdtemp(prefix="kvf-ray-")
    ray.init(num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False,
             object_store_memory=RAY_OBJECT_STORE_BYTES, log_to_driver=log_to_driver,
             _temp_dir=_ray_temp_dir, runtime_env={"env_vars": dict(RAY_ENV)})


def shutdown_ray() -> None:
    """Stop the Ray that :func:`init_ray` started here and remove its session directory."""
    import ray

    global _ray_temp_dir
    ray.shutdown()
    if _ray_temp_dir is not None:
        shutil.rmtree(_ray_temp_dir, ignore_errors=True)
        _ray_temp_dir = None


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
