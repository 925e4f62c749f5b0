"""Small gRPC helpers shared by the router and worker servers."""

from __future__ import annotations

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


async def mark_serving(servicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def bind_port(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind an insecure port; returns the bound port.

    Raises:
        OSError: the port is taken (the message names it).
    """
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpc raises RuntimeError on a failed bind
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: address in use or not permitted")
    return bound

# Without this, two servers can silently share one port (grpc enables SO_REUSEPORT).
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]
