"""Router process entry point: ``python -m kvfleet.router.main --redis-url … --model …``.

Prints one line ``router ready <host:port>`` on stdout once it accepts requests; stops
cleanly on SIGINT/SIGTERM; SIGHUP re-reads the API-key file and the internal TLS directory
(key and certificate rotation without a restart).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Optional

import grpc

from kvfleet import priority
from kvfleet.grpc_auth import AuthInterceptor
from kvfleet.grpc_util import SERVER_OPTIONS, add_health_and_reflection, bind_port, mark_serving
from kvfleet.index_keys import DEFAULT_NAMESPACE
from kvfleet.router.auth import Authenticator
from kvfleet.router.capacity import DEFAULT_RETRY_PUSHBACK_MS
from kvfleet.router.core import PromptLimits, RouterCore
from kvfleet.router.http_front import DEFAULT_MAX_CONNECTIONS, HttpFront
from kvfleet.router.index_mirror import MirroredPrefixIndex
from kvfleet.router.policy import make_policy
from kvfleet.router.prefix_index import PrefixIndex, RedisPrefixIndex
from kvfleet.router.presence import RouterPresence
from kvfleet.router.replica_set import ReplicaSet
from kvfleet.router.served_model import ServedModel
from kvfleet.router.server import RouterService
from kvfleet.router.tenant_limits import TenantLimiter
from kvfleet.router.worker_link import DEFAULT_CALL_IDLE_S
from kvfleet.secrets import REDIS_PASSWORD_ENV, with_redis_password
from kvfleet.stream_limits import DEFAULT_MAX_UNREAD, DEFAULT_STALL_S, StreamLimits
from kvfleet.telemetry import Telemetry, TelemetryConfig
from kvfleet.telemetry.router_spans import RouterTelemetry
from kvfleet.tls import InternalTLS, credentials_loader, server_credentials
from kvfleet.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    """One router process's settings (its flags: :func:`parse_args`). Empty ``redis_url``,
    ``model_name``, ``model_dir``: not chosen yet (a cluster config fills them from its
    replicas', kvfleet.deploy.cluster_config); the router needs all three to start."""

    redis_url: str = ""
    model_name: str = ""
    model_dir: str = ""
    block_size: int = 16
    kv_dtype: str = "float32"
    quantization: str = "none"  # the replicas' weights, part of the cache identity
    quant_group_size: int = 32
    host: str = "127.0.0.1"
    port: int = 50051
    # The OpenAI-compatible HTTP front (kvfleet.router.http_front) on this port, same host;
    # None = off, 0 = a free port.
    http_port: Optional[int] = None
    http_max_connections: int = DEFAULT_MAX_CONNECTIONS  # past it the HTTP front answers 503
    policy: str = "prefix_aware"
    namespace: str = DEFAULT_NAMESPACE
    api_keys_file: Optional[str] = None
    replica_ttl_s: float = 10.0
    # Answer prefix lookups from an in-memory mirror that follows the workers' KV event log
    # (kvfleet.router.index_mirror); False = one Redis round trip per request.
    index_mirror: bool = True
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # OTLP / Prometheus
    log_level: str = "INFO"  # DEBUG adds a line per routing decision
    # prefix_aware knobs (kvfleet.router.policy): load_penalty_blocks, max_imbalance,
    # popularity_window, kv_saturation, min_excess_load, host_hit_weight; empty = the
    # documented defaults.
    policy_options: dict = field(default_factory=dict)
    retry_pushback_ms: int = DEFAULT_RETRY_PUSHBACK_MS  # RESOURCE_EXHAUSTED's retry hint
    # On SIGTERM/SIGINT: new calls are refused at once, open streams get this long to end.
    shutdown_grace_s: float = 2.0
    tls_cert: Optional[str] = None  # PEM files: serve the client port over TLS
    tls_key: Optional[str] = None
    internal_tls_dir: Optional[str] = None  # mutual TLS to the workers (kvfleet.tls)
    # Slow or vanished readers: messages buffered per stream, seconds a write may wait.
    stream_limits: StreamLimits = field(default_factory=StreamLimits)
    # A worker call with no frame for this long (its replica alive) fails INTERNAL.
    call_idle_s: float = DEFAULT_CALL_IDLE_S
    # What one request may ask to tokenize (bytes, messages, prompts), and the threads doing it.
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    # Per priority class: the fraction of fleet capacity past which its requests are refused
    # (kvfleet.priority.DEFAULT_ADMIT: batch at 80 %, the others at 100 %).
    priority_admit: dict = field(default_factory=lambda: dict(priority.DEFAULT_ADMIT))
    # In-flight requests a tenant without its own key-file limit may hold across every router
    # of the namespace (kvfleet.router.tenant_limits); None = the key file's share only.
    tenant_max_inflight: Optional[int] = None

    def __post_init__(self) -> None:
        priority.check_admit(self.priority_admit, "--priority-admit")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tenant_max_inflight is not None and not (
                isinstance(self.tenant_max_inflight, int) and self.tenant_max_inflight >= 1):
            raise ValueError(f"--tenant-max-inflight must be an integer >= 1, got "
                             f"{self.tenant_max_inflight!r}")


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
        internal = InternalTLS.load(cfg.internal_tls_dir) if cfg.internal_tls_dir else None
        self.replicas = ReplicaSet(index, credentials=internal and internal.router_credentials(),
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


def parse_args(argv: list[str]) -> RouterConfig:
    p = argparse.ArgumentParser(prog="kvfleet-router", description=__doc__)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--model-name", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", default="float32")
    p.add_argument("--quantization", default="none",
                   help="the replicas' weight-only quantization (part of the cache identity)")
    p.add_argument("--quant-group-size", type=int, default=32)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (0 = a free "
                        "one; default: off)")
    p.add_argument("--http-max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open HTTP connections served at once; past it: 503")
    p.add_argument("--policy", default="prefix_aware")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    p.add_argument("--api-keys", default=None, help="JSON file mapping API keys to tenants")
    p.add_argument("--load-penalty-blocks", type=float, default=None,
                   help="prefix_aware: matched blocks one request of load is worth")
    p.add_argument("--max-imbalance", type=float, default=None,
                   help="prefix_aware: fair shares of traffic one holder of a prefix may carry "
                        "before the prefix gets another holder")
    p.add_argument("--popularity-window", type=int, default=None,
                   help="prefix_aware: routing decisions the prefix popularity averages over")
    p.add_argument("--min-excess-load", type=float, default=None,
                   help="prefix_aware: requests over the fleet's mean load a holder must carry, "
                        "besides --max-imbalance times the mean, before its prefixes get copies")
    p.add_argument("--host-hit-weight", type=float, default=None,
                   help="prefix_aware / predicted_ttft: what a block in a replica's node host "
                        "KV tier is worth next to one in its device pool, 0..1 (default: 0.95, "
                        "from restore vs prefill seconds per block: router/tier_credit.py)")
    p.add_argument("--no-index-mirror", dest="index_mirror", action="store_false",
                   help="look every prompt up in Redis (one round trip per request) instead of "
                        "an in-memory mirror of the index fed by the workers' KV event log")
    p.add_argument("--tls-cert", help="PEM certificate (chain): serve the client port over TLS "
                                      "(and the HTTP port as HTTPS)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--internal-tls-dir",
                   help="cluster CA + router certificate (kvfleet.tls): mutual TLS to workers")
    p.add_argument("--tenant-max-inflight", type=int, default=None,
                   help="in-flight requests a tenant without its own key-file limit may hold "
                        "across every router sharing this Redis namespace (default: none)")
    p.add_argument("--retry-pushback-ms", type=int, default=DEFAULT_RETRY_PUSHBACK_MS,
                   help="retry hint (grpc-retry-pushback-ms trailer) sent with RESOURCE_EXHAUSTED")
    p.add_argument("--priority-admit", default="", metavar="CLASS=FRACTION,...",
                   help="refuse a priority class's requests once the fleet holds this fraction "
                        "of its capacity, keeping the rest for higher classes (default "
                        f"{priority.format_admit(priority.DEFAULT_ADMIT)})")
    p.add_argument("--stream-max-unread", type=int, default=DEFAULT_MAX_UNREAD,
                   help="messages one response stream may buffer for a client that does not "
                        "read before it is cancelled")
    p.add_argument("--stream-stall-s", type=float, default=DEFAULT_STALL_S,
                   help="seconds one write may wait for a client that does not read before "
                        "its stream is cancelled")
    p.add_argument("--call-idle-s", type=float, default=DEFAULT_CALL_IDLE_S,
                   help="seconds a request may wait for its worker's next message while the "
                        "replica is up before it fails INTERNAL (a lost worker task)")
    defaults = PromptLimits()
    p.add_argument("--max-prompt-bytes", type=int, default=defaults.max_prompt_bytes,
                   help="UTF-8 bytes of text (or of all messages' content) per prompt; past it: "
                        "INVALID_ARGUMENT / HTTP 413")
    p.add_argument("--max-messages", type=int, default=defaults.max_messages,
                   help="chat messages per prompt; past it: INVALID_ARGUMENT / HTTP 413")
    p.add_argument("--max-prompts-per-request", type=int, default=defaults.max_prompts,
                   help="prompts in one HTTP completions request (an array prompt); past it: 413")
    p.add_argument("--tokenizer-threads", type=int, default=defaults.tokenizer_threads,
                   help="threads that tokenize and apply chat templates off the event loop")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="stderr log level (DEBUG: one line per routing decision)")
    p.add_argument("--shutdown-grace-s", type=float, default=2.0,
                   help="on SIGTERM, how long open streams may run on before they are cut "
                        "(default 2; a pod's terminationGracePeriodSeconds must exceed it)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0 = a free one); OTLP export "
                        "follows the standard OTEL_* environment variables")
    a = p.parse_args(argv)
    if a.http_max_connections < 1:
        p.error("--http-max-connections must be >= 1")
    if bool(a.tls_cert) != bool(a.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if not a.call_idle_s > 0:
        p.error(f"--call-idle-s must be > 0, got {a.call_idle_s}")
    if not a.shutdown_grace_s >= 0:
        p.error(f"--shutdown-grace-s must be >= 0, got {a.shutdown_grace_s}")
    try:
        telemetry = TelemetryConfig.from_env(os.environ, metrics_port=a.metrics_port)
        stream_limits = StreamLimits(a.stream_max_unread, a.stream_stall_s)
        prompt_limits = PromptLimits(a.max_prompt_bytes, a.max_messages,
                                     a.max_prompts_per_request, a.tokenizer_threads)
        return _config(a, telemetry, stream_limits, prompt_limits)
    except ValueError as exc:
        p.error(str(exc))


def _config(a: argparse.Namespace, telemetry: TelemetryConfig, stream_limits: StreamLimits,
            prompt_limits: PromptLimits) -> RouterConfig:
    # The Redis password comes from the environment, never the command line (kvfleet.secrets).
    redis_url = with_redis_password(a.redis_url, os.environ.get(REDIS_PASSWORD_ENV))
    return RouterConfig(redis_url=redis_url, model_name=a.model_name, model_dir=a.model_dir,
                        block_size=a.block_size, kv_dtype=a.kv_dtype, quantization=a.quantization,
                        quant_group_size=a.quant_group_size, host=a.host, port=a.port,
                        http_port=a.http_port, http_max_connections=a.http_max_connections,
                        policy=a.policy, namespace=a.namespace, api_keys_file=a.api_keys,
                        index_mirror=a.index_mirror, telemetry=telemetry,
                        log_level=a.log_level, retry_pushback_ms=a.retry_pushback_ms,
                        shutdown_grace_s=a.shutdown_grace_s,
                        tls_cert=a.tls_cert, tls_key=a.tls_key,
                        internal_tls_dir=a.internal_tls_dir, stream_limits=stream_limits,
                        call_idle_s=a.call_idle_s, prompt_limits=prompt_limits,
                        priority_admit=priority.parse_admit(a.priority_admit),
                        tenant_max_inflight=a.tenant_max_inflight,
                        policy_options={
                            k: v for k in ("load_penalty_blocks", "max_imbalance",
                                           "popularity_window", "min_excess_load",
                                           "host_hit_weight")
                            if (v := getattr(a, k)) is not None})


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
    # of the cyclic GC, whose full collections otherwise stop the loop for ~30 ms here.
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
