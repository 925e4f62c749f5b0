"""Router process entry point: ``python -m kvfleet.router.main --redis-url … --model-name …``
(flags: kvfleet.router.flags; settings: kvfleet.router.config).

Prints one line ``router ready <host:port>`` on stdout once it accepts requests; stops
cleanly on SIGINT/SIGTERM; SIGHUP re-reads the API-key file and the internal TLS directory
(key and certificate rotation without a restart).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import Optional

import grpc

from kvfleet.grpc_auth import AuthInterceptor
from kvfleet.grpc_util import SERVER_OPTIONS, add_health_and_reflection, bind_port, mark_serving
from kvfleet.router.auth import Authenticator
from kvfleet.router.config import RouterConfig
from kvfleet.router.core import RouterCore
from kvfleet.router.flags import parse_args
from kvfleet.router.http_front import HttpFront
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.policy import make_policy
from kvfleet.router.prefix_index import PrefixIndex, RedisPrefixIndex
from kvfleet.router.presence import RouterPresence
from kvfleet.router.replica_set import ReplicaSet
from kvfleet.router.served_model import ServedModel
from kvfleet.router.server import RouterService
from kvfleet.router.tenant_limits import TenantLimiter
from kvfleet.telemetry import Telemetry
from kvfleet.telemetry.router_spans import RouterTelemetry
from kvfleet.tls import RouterTLS, credentials_loader, server_credentials
from kvfleet.v1 import router_pb2, router_pb2_grpc

__all__ = ["RouterConfig", "RouterServer", "main", "parse_args"]

log = logging.getLogger(__name__)


class RouterServer:
    """The router's gRPC server and its collaborators, on the current asyncio loop."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.address: Optional[str] = None
        self._server: Optional[grpc.aio.Server] = None
        self.replicas: Optional[ReplicaSet] = None
        self.core: Optional[RouterCore] = None  # the request path both edges call
        self.service: Optional[RouterService] = None
        self.telemetry: Optional[Telemetry] = None
        self.metrics_address: Optional[str] = None  # Prometheus endpoint, when one is served
        self.http: Optional[HttpFront] = None
        self.http_address: Optional[str] = None  # host:port of the HTTP front, when on
        self.presence: Optional[RouterPresence] = None  # {ns}router:{id} in Redis

    async def start(self) -> str:
        """Start serving; returns ``host:port``. Raises OSError if the port is taken."""
        cfg = self.cfg
        policy = make_policy(cfg.policy, **cfg.policy_options)
        auth = Authenticator.from_file(cfg.api_keys_file)
        model = ServedModel.load(cfg.model_name, cfg.model_dir, cfg.block_size, cfg.kv_dtype,
                                 cfg.quantization, cfg.quant_group_size)
        redis_index = RedisPrefixIndex(cfg.redis_url, namespace=cfg.namespace,
                                       replica_ttl_s=cfg.replica_ttl_s)
        index: PrefixIndex = redis_index
        if cfg.index_mirror:
            mirror = MirroredPrefixIndex(redis_index, cfg.redis_url, namespace=cfg.namespace)
            mirror.start()
            index = mirror
        # Every RPC is authorised in one place (the service's authorize, on the core built below).
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[
            AuthInterceptor(self._authorize)])
        creds = (server_credentials(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key
                 else None)
        port = bind_port(self._server, cfg.host, cfg.port, creds)
        self.address = f"{cfg.host}:{port}"
        internal = RouterTLS.load(cfg.internal_tls_dir) if cfg.internal_tls_dir else None
        self.replicas = ReplicaSet(index, credentials=internal and internal.credentials(),
                                   identities={model.name: model.identity.digest().hex()})
        await self.replicas.start()
        self.telemetry = Telemetry(cfg.telemetry, "router")
        self.metrics_address = self.telemetry.metrics_address
        limiter = TenantLimiter(cfg.redis_url, cfg.namespace)  # tenant limits, fleet-wide
        limiter.start()
        self.core = RouterCore({model.name: model}, model.name, self.replicas, policy, auth,
                               telemetry=RouterTelemetry(self.telemetry),
                               retry_pushback_ms=cfg.retry_pushback_ms,
                               stream_limits=cfg.stream_limits, call_idle_s=cfg.call_idle_s,
                               prompt_limits=cfg.prompt_limits,
                               priority_admit=cfg.priority_admit, tenant_limiter=limiter,
                               tenant_max_inflight=cfg.tenant_max_inflight)
        service = RouterService(self.core)
        self.service = service
        router_pb2_grpc.add_RouterServicer_to_server(service, self._server)
        name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
        health = add_health_and_reflection(self._server, [name])
        if cfg.http_port is not None:
            self.http = HttpFront(self.core, cfg.host, cfg.http_port, cfg.http_max_connections,
                                  shutdown_grace_s=cfg.shutdown_grace_s,
                                  tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
            self.http_address = await self.http.start()
        await self._server.start()
        await mark_serving(health, [name])
        self.presence = RouterPresence(cfg.redis_url, cfg.namespace, {
            "address": self.address, "http_address": self.http_address or "",
            "policy": cfg.policy, "model": cfg.model_name,
            "identity": model.identity.digest().hex()})
        self.presence.start()
        service.presence = self.presence
        return self.address

    def _authorize(self, method: str, context) -> str:
        assert self.service is not None  # the server takes calls only once start() built it
        return self.service.authorize(method, context)

    def reload_api_keys(self) -> bool:
        """Re-read the API-key file (key rotation; SIGHUP): new requests use it at once. A
        file that does not parse is logged and the previous keys stay. Returns success."""
        if not self.cfg.api_keys_file or self.core is None:
            return False
        try:
            self.core.auth = Authenticator.from_file(self.cfg.api_keys_file)
        except (OSError, ValueError) as exc:
            log.error("API keys not reloaded, keeping the previous ones: %s", exc)
            return False
        log.info("API keys reloaded from %s", self.cfg.api_keys_file)
        return True

    def reload_internal_tls(self) -> bool:
        """Re-read the internal TLS directory (certificate rotation; SIGHUP): channels opened
        from now on present the new router certificate and trust the new CA bundle; open ones
        keep their TLS session. Files that do not load (or a key that is not its certificate's)
        are logged and the previous credentials stay. Returns success."""
        if not self.cfg.internal_tls_dir or self.replicas is None:
            return False
        try:
            creds = credentials_loader(self.cfg.internal_tls_dir)()
        except (OSError, ValueError) as exc:
            log.error("internal TLS not reloaded, keeping the previous certificates: %s", exc)
            return False
        self.replicas.credentials = creds
        log.info("internal TLS reloaded from %s", self.cfg.internal_tls_dir)
        return True

    def reload(self) -> None:
        """SIGHUP: the API-key file and the internal TLS directory, each kept on failure."""
        self.reload_api_keys()
        self.reload_internal_tls()

    async def stop(self, grace_s: Optional[float] = None) -> None:
        """Refuse new calls on both ports at once, let open streams on both run on for
        ``grace_s`` seconds (default: ``cfg.shutdown_grace_s``), then cut the rest."""
        grace_s = self.cfg.shutdown_grace_s if grace_s is None else grace_s
        if self.presence is not None:
            await self.presence.close()
            self.presence = None
        stopping = []  # both ports together: the grace is not spent twice
        if self.http is not None:
            stopping.append(self.http.stop(grace_s))
            self.http = None
        if self._server is not None:
            stopping.append(self._server.stop(grace_s))
            self._server = None
        await asyncio.gather(*stopping)
        if self.core is not None:
            self.core.close()
            await self.core.tenant_limiter.close()
        if self.replicas is not None:
            await self.replicas.close()
            self.replicas = None
        if self.telemetry is not None:
            self.telemetry.shutdown()  # flushes the last spans
            self.telemetry = None


async def _serve(cfg: RouterConfig) -> int:
    server = RouterServer(cfg)
    try:
        address = await server.start()
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if server.metrics_address:
        log.info("Prometheus metrics on http://%s/metrics", server.metrics_address)
    if server.http_address:  # a log line: stdout carries only the ready line launchers wait for
        log.info("OpenAI-compatible HTTP API on %s://%s/v1", "https" if cfg.tls_cert else "http",
                 server.http_address)
    # What start-up built (modules, tokenizer, stubs) lives as long as the process: keep it out
    # of the cyclic GC, whose full collections otherwise stop the loop (docs/design.md §10).
    gc.collect()
    gc.freeze()
    print(f"router ready {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    await stop.wait()
    await server.stop()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    return asyncio.run(_serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
