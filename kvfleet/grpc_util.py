"""Small gRPC helpers shared by the router and worker servers."""

from __future__ import annotations

import socket
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Streams carry one message per engine step; keep messages small but allow big prompts.
MAX_MESSAGE_BYTES = 64 << 20  # 64 MiB; the HTTP front's request body limit too
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Serve ``grpc.health.v1.Health`` (every service SERVING) and server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)
    return servicer


async def mark_serving(servicer, service_names: list[str], serving: bool = True) -> None:
    """Set the health status of the server and each service (``serving=False``: NOT_SERVING)."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await servicer.set(name, status)


def bind_port(server: grpc.aio.Server, host: str, port: int,
              credentials: Optional[grpc.ServerCredentials] = None) -> int:
    """Bind a port (TLS with ``credentials``, else plaintext); returns the bound port.

    Raises:
        OSError: the port is taken (the message names it).
    """
    try:
        if credentials is not None:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpc raises RuntimeError on a failed bind
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: address in use or not permitted")
    return bound


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def advertised_host(host: str) -> str:
    """The host others dial for a server bound to ``host``: ``host`` itself, or for a
    wildcard (``0.0.0.0``, every interface: a pod or a host of a multi-node cluster) this
    node's address as Ray knows it (a Kubernetes pod's IP under KubeRay), else the address
    the host name resolves to."""
    if host not in WILDCARD_HOSTS:
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # a process without Ray (tests of the server alone)
        pass
    return socket.gethostbyname(socket.gethostname())


# RPCs that reached gRPC core but that the Python server has not picked up yet. Core's defaults
# (soft 1,000, hard 3,000, random early rejection in between) end the excess with status
# CANCELLED, details "CANCELLED", before any handler runs: a burst on one router lost requests
# that way (``python -m bench overload burst``; docs/design.md §10). Up to this many wait instead, so the
# server's own admission answers each one (RESOURCE_EXHAUSTED, in milliseconds); past it core
# still rejects. A pending call holds its headers and at most one flow-control window of body.
MAX_PENDING_RPCS = 20_000

# Router → worker channels ping their replica every 10 s and drop the connection when a ping
# is not answered within 5 s: a replica process that hangs (SIGSTOP, a deadlock) then fails
# its open streams UNAVAILABLE instead of leaving them open forever (TCP alone still ACKs).
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000
WORKER_KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                            # gRPC core's own ping timeout (60 s by default) bounds it too
                            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                            ("grpc.keepalive_permit_without_calls", 1),
                            ("grpc.http2.max_pings_without_data", 0)]
# ... and servers accept those pings (by default a ping more often than every 5 min is abuse).
_ACCEPT_PINGS = [("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.max_ping_strikes", 0)]

# Without so_reuseport 0, two servers can silently share one port (grpc enables SO_REUSEPORT).
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0),
                  ("grpc.server.max_pending_requests", MAX_PENDING_RPCS),
                  ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_RPCS),
                  *_ACCEPT_PINGS]
