"""The router's flags as one table (kvfleet.flag_table): :func:`parse_args` builds its parser
from :data:`ROUTER_FLAGS` and :func:`router_argv` renders a :class:`RouterConfig` back to the
command line that parses to it (what ``kvfleet up`` and the Kubernetes router Deployment run).
``kvfleet up`` takes the rows it shares from here (kvfleet.deploy.cluster_flags). Defaults are
RouterConfig's (and its parts'); rules between flags are RouterConfig's to check.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping, Optional, Sequence

from kvfleet.allocator.fingerprint import QUANT_METHODS
from kvfleet.arg_types import even_int, positive_int, priority_admit
from kvfleet.flag_table import Flag, add_flags, declared_default, render_argv, values_by_owner
from kvfleet.priority import format_admit
from kvfleet.router.config import RouterConfig
from kvfleet.router.core import PromptLimits
from kvfleet.router.policy import POLICIES
from kvfleet.secrets import REDIS_PASSWORD_ENV, split_redis_password, with_redis_password
from kvfleet.stream_limits import StreamLimits
from kvfleet.telemetry import TelemetryConfig

# Config path prefix -> what holds the fields below it ("" = RouterConfig; a dict: its keys).
OWNERS: dict[str, type] = {"": RouterConfig, "stream_limits": StreamLimits,
                           "prompt_limits": PromptLimits, "telemetry": TelemetryConfig,
                           "policy_options": dict}
POLICY_OPTIONS = ("load_penalty_blocks", "max_imbalance", "popularity_window", "min_excess_load",
                  "host_hit_weight")

# In the order router_argv writes them (what kvfleet up and the k8s manifests run).
ROUTER_FLAGS: tuple[Flag, ...] = (
    Flag("--redis-url", "redis_url", "the prefix index, replica registry and load reports (a "
         "password comes from the environment, never the command line)", "fleet",
         required=True, always=True, show=lambda url: split_redis_password(url)[0]),
    Flag("--model-name", "model_name", "served model name", "model", required=True, always=True),
    Flag("--model-dir", "model_dir", "the served model's directory (tokenizer, chat template, "
         "identity)", "model", required=True, always=True),
    Flag("--block-size", "block_size", "tokens per KV block (default {default}): the replicas'",
         "cache", type=int, always=True),
    Flag("--kv-dtype", "kv_dtype", "the replicas' KV dtype, part of the cache identity (default "
         "{default})", "cache", always=True),
    Flag("--quantization", "quantization", "weight-only quantization of every projection, the "
         "embedding and the LM head (default {default}): int8 or int4, from the checkpoint's "
         "floats, a GGUF beside them or a GPTQ/AWQ checkpoint, read as they are where they "
         "map; part of the cache identity", "model", choices=QUANT_METHODS),
    Flag("--quant-group-size", "quant_group_size", "inputs sharing one scale when weights are "
         "quantized at load from floats (default {default}); tensors read as they are from a "
         "GGUF or GPTQ/AWQ checkpoint keep their own groups", "model", type=even_int("--quant-group-size")),
    Flag("--host", "host", "interface both ports bind (default {default})", "fleet", always=True),
    Flag("--port", "port", "router port (default {default}; 0 = a free port)", "fleet", type=int,
         always=True),
    Flag("--policy", "policy", "routing policy (default {default})", "routing",
         choices=tuple(POLICIES), always=True),
    Flag("--namespace", "namespace", "Redis key prefix the replicas share (default {default})",
         "fleet", always=True),
    Flag("--api-keys", "api_keys_file", "JSON file mapping API keys to tenants (default: open)",
         "security"),
    Flag("--tls-cert", "tls_cert", "PEM certificate (chain): serve the router's client port over "
         "TLS (and the HTTP port as HTTPS)", "security"),
    Flag("--tls-key", "tls_key", "PEM private key of --tls-cert", "security"),
    Flag("--internal-tls-dir", "internal_tls_dir", "cluster CA + router certificate "
         "(kvfleet.tls): mutual TLS to the workers", "security"),
    Flag("--no-index-mirror", "index_mirror", "look every prompt up in Redis (one round trip per "
         "request) instead of an in-memory mirror of the index fed by the workers' KV event "
         "log", "routing", action="store_false"),
    Flag("--http-max-connections", "http_max_connections", "open HTTP connections served at "
         "once; past it: 503 (default {default})", "fleet", type=int),
    Flag("--retry-pushback-ms", "retry_pushback_ms", "retry hint (grpc-retry-pushback-ms "
         "trailer) sent with RESOURCE_EXHAUSTED (default {default})", "scheduling", type=int),
    Flag("--log-level", "log_level", "stderr log level (DEBUG: one line per routing decision; "
         "default {default})", "observability", choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Flag("--shutdown-grace-s", "shutdown_grace_s", "on SIGTERM, how long open streams may run "
         "on before they are cut (default {default}; a pod's terminationGracePeriodSeconds must "
         "exceed it)", "fleet", type=float),
    Flag("--tenant-max-inflight", "tenant_max_inflight", "in-flight requests one tenant (without "
         "its own key-file limit) may hold across every router of the namespace, counted in "
         "Redis (default: no limit beyond the key file's)", "scheduling",
         type=positive_int("--tenant-max-inflight")),
    Flag("--load-penalty-blocks", "policy_options.load_penalty_blocks", "prefix_aware (and "
         "predicted_ttft where a report lacks the forecast): matched blocks one request of load "
         "is worth", "routing", type=float),
    Flag("--max-imbalance", "policy_options.max_imbalance", "fair shares of "
         "traffic one holder of a prefix may carry before the prefix gets another holder",
         "routing", type=float),
    Flag("--popularity-window", "policy_options.popularity_window", "routing "
         "decisions the prefix popularity averages over", "routing", type=int),
    Flag("--min-excess-load", "policy_options.min_excess_load", "prefix_aware's bound: requests "
         "over the fleet's mean load a holder must carry, besides --max-imbalance times the mean, "
         "before its prefixes get copies", "routing", type=float),
    Flag("--host-hit-weight", "policy_options.host_hit_weight", "what a block in a replica's "
         "node host KV tier is worth next to one in its device pool, 0..1 (default: from "
         "restore vs prefill seconds per block, kvfleet.router.tier_credit)", "routing",
         type=float),
    Flag("--priority-admit", "priority_admit", "refuse a priority class's requests once the fleet "
         "holds this fraction of its capacity, keeping the rest for higher classes (default "
         "{default})", "scheduling", type=priority_admit, show=format_admit,
         metavar="CLASS=FRACTION,..."),
    Flag("--stream-max-unread", "stream_limits.max_unread", "messages one response stream may "
         "buffer for a client that does not read before it is cancelled (default {default})",
         "fleet", type=int),
    Flag("--stream-stall-s", "stream_limits.stall_s", "seconds one write may wait for a client "
         "that does not read before its stream is cancelled (default {default})", "fleet",
         type=float),
    Flag("--http-port", "http_port", "also serve the OpenAI-compatible HTTP API on this port "
         "(0 = a free one; default: off)", "fleet", type=int),
    Flag("--metrics-port", "telemetry.metrics_port", "serve Prometheus metrics on this port (0 = "
         "a free one); OTLP export follows the standard OTEL_* environment variables",
         "observability", type=int),
    Flag("--call-idle-s", "call_idle_s", "seconds a request may wait for its worker's next "
         "message while the replica is up before it fails INTERNAL (a lost worker task; "
         "default {default})", "fleet", type=float),
    Flag("--max-prompt-bytes", "prompt_limits.max_prompt_bytes", "UTF-8 bytes of text (or of "
         "all messages' content) per prompt; past it: INVALID_ARGUMENT / HTTP 413 (default "
         "{default})", "scheduling", type=int),
    Flag("--max-messages", "prompt_limits.max_messages", "chat messages per prompt; past it: "
         "INVALID_ARGUMENT / HTTP 413 (default {default})", "scheduling", type=int),
    Flag("--max-prompts-per-request", "prompt_limits.max_prompts", "prompts in one HTTP "
         "completions request (an array prompt); past it: 413 (default {default})",
         "scheduling", type=int),
    Flag("--tokenizer-threads", "prompt_limits.tokenizer_threads", "threads that tokenize and "
         "apply chat templates off the event loop (default {default})", "fleet", type=int),
)


def build_parser() -> argparse.ArgumentParser:
    """``python -m kvfleet.router.main``'s parser, from :data:`ROUTER_FLAGS`."""
    p = argparse.ArgumentParser(prog="kvfleet-router",
                                description="The router process (kvfleet.router.main).")
    add_flags(p, ROUTER_FLAGS, "router", lambda f: declared_default(OWNERS, f.field or ""))
    return p


def parse_args(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> RouterConfig:
    """The RouterConfig of ``argv`` (the Redis password and OTLP settings from ``environ``,
    default ``os.environ``). A bad value or a config RouterConfig refuses exits 2 (argparse)
    with a message naming the flag."""
    p = build_parser()
    a = p.parse_args(list(argv))
    try:
        return router_config(a, os.environ if environ is None else environ)
    except ValueError as exc:
        p.error(str(exc))


def router_config(a: argparse.Namespace, environ: Mapping[str, str]) -> RouterConfig:
    """RouterConfig from parsed :data:`ROUTER_FLAGS`. Raises ValueError naming the flag."""
    v: dict[str, dict[str, Any]] = values_by_owner(a, ROUTER_FLAGS, OWNERS)
    own = v[""]
    # The Redis password comes from the environment, never the command line (kvfleet.secrets).
    own["redis_url"] = with_redis_password(own["redis_url"], environ.get(REDIS_PASSWORD_ENV))
    return RouterConfig(telemetry=TelemetryConfig.from_env(environ, **v["telemetry"]),
                        stream_limits=StreamLimits(**v["stream_limits"]),
                        prompt_limits=PromptLimits(**v["prompt_limits"]),
                        policy_options={k: x for k, x in v["policy_options"].items()
                                        if x is not None}, **own)


_DEFAULTS = RouterConfig()


def router_argv(router: RouterConfig) -> list[str]:
    """The command line (``python -m kvfleet.router.main ARGS``) whose parse is ``router``:
    its settings that differ from the defaults, the ``always`` rows, in :data:`ROUTER_FLAGS`
    order. Telemetry's OTLP settings travel as ``OTEL_*`` variables and a password in
    ``redis_url`` in the environment (kvfleet.deploy.cluster_config.router_env).

    Raises:
        ValueError: a setting the router has no flag for (``replica_ttl_s`` not the
            default), or an unknown policy option.
    """
    if router.replica_ttl_s != _DEFAULTS.replica_ttl_s:
        raise ValueError("router.replica_ttl_s has no router flag: leave it at its default")
    unknown = sorted(set(router.policy_options) - set(POLICY_OPTIONS))
    if unknown:
        raise ValueError(f"router.policy_options: unknown option(s) {unknown}")
    return render_argv(router, _DEFAULTS, ROUTER_FLAGS)
