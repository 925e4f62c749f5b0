"""``kvfleet up`` / ``demo``'s cluster flags as one table: flag, the config field it sets,
type and help. The parser is built from it and :func:`cluster_config` assembles the
:class:`~kvfleet.deploy.cluster_config.ClusterConfig` from it; defaults are the config
dataclasses' own (ReplicaConfig, RouterConfig, SchedulerConfig, ClusterConfig), never
restated here (``{default}`` in a help text shows the declared one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvfleet.allocator.units import format_bytes, parse_size
from kvfleet.constraint import GrammarConfig
from kvfleet.deploy.arg_types import (
    fraction,
    int_range,
    non_negative_float,
    positive_float,
    positive_int,
    positive_seconds,
    priority_admit,
)
from kvfleet.deploy.autoscale_serve import AutoscaleConfig
from kvfleet.deploy.cluster_config import ClusterConfig, with_default_internal_tls
from kvfleet.deploy.models import DEFAULT_MODEL, resolve_model
from kvfleet.router.main import RouterConfig
from kvfleet.router.policy import POLICIES as ROUTING_POLICIES
from kvfleet.telemetry import TelemetryConfig
from kvfleet.worker.engine.scheduler import SchedulerConfig
from kvfleet.worker.engine.scheduler_config import POLICIES as ADMISSION_POLICIES
from kvfleet.worker.replica.autoscale import AutoscaleTargets
from kvfleet.worker.replica.replica import DEFAULT_KV_MEMORY_BYTES, EXECUTORS, ReplicaConfig
from kvfleet.worker.runner.quant.config import METHODS

DECLARED: Any = object()  # the field's default in its dataclass
# Config path prefix -> the dataclass holding the fields below it ("" = ClusterConfig).
OWNERS: dict[str, type] = {"": ClusterConfig, "replica": ReplicaConfig, "router": RouterConfig,
                           "replica.scheduler": SchedulerConfig, "replica.grammar": GrammarConfig}


@dataclass(frozen=True)
class Flag:
    """One command-line flag. ``field``: the config field it sets, as a path under
    ClusterConfig (``"replica.scheduler.max_num_seqs"``); None for a flag
    :func:`cluster_config` reads itself (``dest`` names it). ``convert`` turns a parsed
    value that is not None into the field's value. ``only``: the commands that take it
    (empty: up and demo). ``exclusive``: flags sharing a name exclude each other."""

    flag: str
    field: Optional[str]
    help: str
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[tuple] = None
    action: Optional[str] = None
    default: Any = DECLARED
    metavar: Optional[str] = None
    dest: Optional[str] = None
    exclusive: Optional[str] = None
    only: tuple[str, ...] = ()
    convert: Optional[Callable[[Any], Any]] = None

    @property
    def name(self) -> str:
        """The argparse destination."""
        return self.dest or (self.field or "").replace(".", "__")


FLAGS: tuple[Flag, ...] = (
    Flag("--model", None, "served model name or HF-format directory (default {default})",
         dest="model", default=DEFAULT_MODEL),
    Flag("--replicas", None, "worker replicas (default %s; not with --autoscale)"
         % ClusterConfig.__dataclass_fields__["replicas"].default, dest="replicas", type=int,
         default=None),
    Flag("--autoscale", None, "let Ray Serve scale the replicas between MIN and MAX with "
         "kvfleet's policy (targets: --slo-ttft-ms, --slo-itl-ms, --target-kv-utilisation)",
         dest="autoscale", type=int_range("--autoscale"), metavar="MIN..MAX"),
    Flag("--slo-ttft-ms", None, "autoscale: time-to-first-token SLO (ms) that the predicted "
         "queue delay and the replicas' TTFT p90 are held under", dest="slo_ttft_ms", type=float),
    Flag("--slo-itl-ms", None, "autoscale: inter-token latency SLO (ms) the replicas' ITL p90 "
         "is held under", dest="slo_itl_ms", type=float),
    Flag("--target-kv-utilisation", None, "autoscale: KV-block utilisation (0..1] to hold the "
         "replicas' mean under", dest="target_kv_utilisation", type=float),
    Flag("--target-load", None, "autoscale: share (0..1] of each replica's decode throughput "
         "to run at; the rest absorbs bursts shorter than a replica's start (default %g)"
         % AutoscaleTargets.target_load, dest="target_load", type=float),
    Flag("--upscale-delay", None, "autoscale: seconds a scale-up decision must persist before "
         "Serve applies it (default %g)" % AutoscaleConfig.upscale_delay_s,
         dest="upscale_delay_s", type=float),
    Flag("--downscale-delay", None, "autoscale: seconds the margin must hold before Serve "
         "removes a replica (default %g)" % AutoscaleConfig.downscale_delay_s,
         dest="downscale_delay_s", type=float),
    Flag("--tp", "replica.tensor_parallel_size",
         "tensor-parallel ranks per replica (default {default}): each rank holds 1/T of the "
         "projections and of the KV heads; --num-blocks/--kv-memory are per rank",
         type=positive_int("--tp")),
    Flag("--device", "replica.device",
         "cuda: one GPU per rank, NCCL between ranks (default {default}, gloo)",
         choices=("cpu", "cuda")),
    Flag("--block-size", "replica.block_size", "tokens per KV block (default {default})", type=int),
    Flag("--num-blocks", "replica.num_blocks", "KV blocks per replica (on every rank)", type=int,
         exclusive="kv-size"),
    Flag("--kv-memory", "replica.kv_memory_bytes",
         f"KV memory per replica rank, e.g. 256MiB (default "
         f"{format_bytes(DEFAULT_KV_MEMORY_BYTES).replace(' ', '')})", type=str,
         exclusive="kv-size", convert=lambda text: parse_size(text, "--kv-memory")),
    Flag("--kv-host-memory", "replica.kv_host_memory_bytes",
         "host KV tier per node, e.g. 1GiB (default: none): evicted blocks are written back "
         "there and restored on a prefix hit; shared by the node's replicas, LRU",
         type=str, convert=lambda text: parse_size(text, "--kv-host-memory")),
    Flag("--no-kv-peer-pull", "replica.kv_peer_pull",
         "never pull a prefix the router says another replica holds (default: with "
         "--kv-host-memory, pull it through the node tier when that beats recomputing it)",
         action="store_false"),
    Flag("--no-kv-hand-over", "replica.kv_hand_over",
         "a draining replica drops its cached blocks (default: with --kv-host-memory, it "
         "writes its hottest blocks back to the node tier first, within its drain timeout)",
         action="store_false"),
    Flag("--kv-prewarm-s", "replica.kv_prewarm_s",
         "with --kv-host-memory: a new replica first restores its node tier's most recently "
         "used blocks of its model into its pool, for at most this many seconds before it "
         "serves (default {default}: off; its first hits then restore at admission)",
         type=non_negative_float("--kv-prewarm-s"), metavar="SECONDS"),
    Flag("--policy", "router.policy", "routing policy (default {default})",
         choices=tuple(ROUTING_POLICIES)),
    Flag("--admission", "replica.scheduler.policy", "worker admission policy (default {default})",
         choices=tuple(ADMISSION_POLICIES)),
    Flag("--quantization", "replica.quantization",
         "weight-only quantization of every projection, the embedding and the LM head "
         "(default {default}): int8 or int4 from the checkpoint's floats, a GGUF beside them "
         "or a GPTQ/AWQ checkpoint, read as they are where they map", choices=METHODS),
    Flag("--quant-group-size", "replica.quant_group_size",
         "inputs sharing one scale when weights are quantized at load (default {default})",
         type=positive_int("--quant-group-size")),
    Flag("--no-one-row-weights", "replica.one_row_weights",
         "hold each weight once: halves weight memory, batch-1 decode ~20%% slower "
         "(default: a second copy streams faster for one-row decode steps)", action="store_false"),
    Flag("--adapter", None, "serve the PEFT LoRA adapter in DIR as NAME (repeatable)",
         dest="adapter", action="append", default=[], metavar="NAME=DIR"),
    Flag("--adapter-dir", None, "serve every adapter subdirectory of DIR, named by it (repeatable)",
         dest="adapter_dir", action="append", default=[], metavar="DIR"),
    Flag("--adapter-root", "replica.adapter_roots",
         "`kvfleet adapter load` may read adapters under DIR (repeatable; the --adapter and "
         "--adapter-dir directories are allowed too; any other path is refused PERMISSION_DENIED)",
         action="append", default=[], metavar="DIR", convert=tuple),
    Flag("--max-loras", "replica.max_loras", "LoRA adapter slots per replica, LRU (default {default})",
         type=positive_int("--max-loras")),
    Flag("--max-lora-rank", "replica.max_lora_rank", "largest adapter rank accepted (default {default})",
         type=positive_int("--max-lora-rank")),
    Flag("--max-num-seqs", "replica.scheduler.max_num_seqs",
         "sequences a replica runs at once (default {default})", type=int),
    Flag("--max-num-batched-tokens", "replica.scheduler.max_num_batched_tokens",
         "tokens one engine step computes (default {default})", type=int),
    Flag("--itl-target-ms", "replica.scheduler.itl_target_ms",
         "inter-token latency target: a step takes prefill tokens only while its predicted time "
         "(the replica's calibrated step-cost model) stays under it; a waiting prompt still "
         "advances every step (default: off, the token budget alone)",
         type=positive_float("--itl-target-ms"), metavar="MS"),
    Flag("--max-grammar-compile-s", "replica.grammar.max_compile_s",
         "structured output: a schema, regex or grammar whose compile takes longer is refused "
         "with INVALID_ARGUMENT (default {default} s)", type=positive_seconds),
    Flag("--grammar-cache-size", "replica.grammar.cache_size",
         "compiled grammars kept per replica, LRU (default {default})",
         type=positive_int("--grammar-cache-size")),
    Flag("--port", "router.port", "router port (default {default}; 0 = a free port)", type=int),
    Flag("--redis-url", "replica.redis_url", "use this Redis instead of starting a private one"),
    Flag("--ray-address", "ray_address", "join this Ray cluster instead of starting one"),
    Flag("--replica-host", "replica.host",
         "interface the replicas serve gRPC on (default {default}; 0.0.0.0 on a cluster spanning "
         "hosts: each replica registers its node's address)"),
    Flag("--api-keys", "router.api_keys_file", "JSON file mapping API keys to tenants (default: open)"),
    Flag("--metrics-port", "metrics_port",
         "Prometheus metrics: the router on this port, each replica on a free one (0 = free "
         "ports). Traces and OTLP metrics follow OTEL_* variables, e.g. "
         "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317", type=int),
    Flag("--executor", "replica.executor",
         "model: the real forward; cost-model: a timed stand-in for the forward only "
         "(scheduler, KV cache, index, gRPC stay real; many per process)", choices=EXECUTORS),
    Flag("--cost-model", None, "calibration JSON for --executor cost-model (default: the "
         "constants measured on SmolLM2 by bench/calibrate.py)", dest="cost_model", metavar="FILE"),
    Flag("--cost-model-scale", None, "multiply the cost model's step times (e.g. 0.05 = 20x faster)",
         dest="cost_model_scale", type=float, default=1.0),
    Flag("--tls-cert", "router.tls_cert", "PEM certificate: serve the router's client port over TLS"),
    Flag("--tls-key", "router.tls_key", "PEM private key of --tls-cert"),
    Flag("--internal-tls-dir", "replica.internal_tls_dir",
         "mutual TLS between router and workers with this directory's cluster CA (generated "
         "there when empty; default: off on loopback, ~/.kvfleet/internal-tls beyond it)"),
    Flag("--drain-timeout", "replica.drain_timeout_s",
         "seconds a stopping replica (scale-down, upgrade, Ctrl-C) waits for its streams before "
         "ending them UNAVAILABLE (default {default})", type=positive_seconds),
    Flag("--tenant-share", "replica.scheduler.tenant_share",
         "fraction of a replica's running + waiting slots one tenant may hold (default "
         "{default}: no per-tenant cap)", type=float),
    Flag("--batch-share", "replica.scheduler.batch_share",
         "fraction of a replica's running slots the batch priority class may hold (default "
         "{default}: no cap)", type=fraction("--batch-share")),
    Flag("--preempt-streaming", "replica.scheduler.preempt_streaming",
         "a higher priority class may also preempt (by recompute) lower-class requests that "
         "have streamed tokens (default: only those that have not)", action="store_true"),
    Flag("--layer-yield", "replica.scheduler.layer_yield",
         "a batch step in flight pauses between decoder layers for a nested step of newly "
         "arrived higher-class prompts (interactive TTFT beside a batch flood; --tp 1 only: "
         "refused otherwise)", action="store_true"),
    Flag("--priority-admit", "router.priority_admit",
         "CLASS=FRACTION,...: refuse a priority class's requests once the fleet holds this "
         "fraction of its capacity, keeping the rest for higher classes (default "
         "interactive=1,default=1,batch=0.8)", type=priority_admit, metavar="CLASS=FRACTION,..."),
    Flag("--tenant-max-inflight", "router.tenant_max_inflight",
         "in-flight requests one tenant (without its own key-file limit) may hold across every "
         "router of the cluster, counted in Redis (default: no limit beyond the key file's)",
         type=positive_int("--tenant-max-inflight")),
    Flag("--http-port", "router.http_port",
         "the router's OpenAI-compatible HTTP API (default {default}; 0 = a free port, -1 = off)",
         type=int, default=8000, only=("up",), convert=lambda port: None if port < 0 else port),
)


def declared_default(path: str) -> Any:
    """The default ``path``'s dataclass declares for it (``"replica.block_size"`` → 16)."""
    owner, _, name = path.rpartition(".")
    spec = {f.name: f for f in dataclasses.fields(OWNERS[owner])}[name]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    assert spec.default_factory is not dataclasses.MISSING, f"{path} has no default"
    return spec.default_factory()


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# The flags `kvfleet k8s render` takes from this table too (its other flags are its own).
AUTOSCALE_FLAGS = ("--autoscale", "--slo-ttft-ms", "--slo-itl-ms", "--target-kv-utilisation",
                   "--upscale-delay", "--downscale-delay")


def add_cluster_args(p: argparse.ArgumentParser, command: str,
                     names: Optional[tuple[str, ...]] = None) -> None:
    """Add :data:`FLAGS` (those ``command`` takes; only ``names`` when given) to ``p``."""
    groups: dict[str, Any] = {}
    for f in FLAGS:
        if (f.only and command not in f.only) or (names is not None and f.flag not in names):
            continue
        default = f.default
        if default is DECLARED:
            default = declared_default(f.field) if f.field else None
        target = p
        if f.exclusive:
            if f.exclusive not in groups:
                groups[f.exclusive] = p.add_mutually_exclusive_group()
            target = groups[f.exclusive]
        kwargs: dict[str, Any] = {"dest": f.name, "default": default,
                                  "help": f.help.replace("{default}", _shown(default))}
        if f.action:
            kwargs["action"] = f.action
        if f.action in ("store_false", "store_true"):
            kwargs.pop("default")  # the flag's absence is the declared default
        else:
            kwargs["metavar"] = f.metavar or f.flag.lstrip("-").upper().replace("-", "_")
        if f.type is not None:
            kwargs["type"] = f.type
        if f.choices is not None:
            kwargs["choices"] = f.choices
            kwargs.pop("metavar", None)
        target.add_argument(f.flag, **kwargs)


def _field_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Parsed table values grouped by the dataclass that declares them (keys of OWNERS)."""
    values: dict[str, dict[str, Any]] = {owner: {} for owner in OWNERS}
    for f in FLAGS:
        if f.field is None or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if f.convert is not None and value is not None:
            value = f.convert(value)
        owner, _, name = f.field.rpartition(".")
        values[owner][name] = value
    return values


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """Build a ClusterConfig from parsed args (of :func:`add_cluster_args`' flags), checking
    what can be checked before anything starts. Raises ModelNotPrepared / ValueError."""
    from kvfleet.worker.executor.cost_model import MEASURED, CostModel
    from kvfleet.worker.replica.adapter_catalog import adapter_roots

    name, model_dir = resolve_model(args.model)
    values = _field_values(args)
    # Beyond loopback: mutual TLS by default (~/.kvfleet/internal-tls), never plaintext.
    replica_values = with_default_internal_tls(values["replica"])
    _check_device(replica_values["device"])
    if values["replica.scheduler"].get("layer_yield") and replica_values["tensor_parallel_size"] != 1:
        raise ValueError("--layer-yield needs --tp 1: a forward pauses between layers only when "
                         "one process runs the whole model")
    if replica_values["tensor_parallel_size"] != 1:  # refuse a split the model cannot take
        from kvfleet.worker.runner.model_config import load_model_config
        from kvfleet.worker.runner.tp.layout import check_tp

        check_tp(load_model_config(model_dir), replica_values["tensor_parallel_size"])
    adapters = _checked_adapters(args, model_dir, replica_values["max_lora_rank"])
    for root in replica_values["adapter_roots"]:
        if not os.path.isdir(root):
            raise ValueError(f"--adapter-root {root}: not a directory")
    # A runtime load may read the start-time adapter directories too, besides --adapter-root's.
    replica_values["adapter_roots"] = adapter_roots(adapters, args.adapter_dir,
                                                    replica_values["adapter_roots"])
    cost = CostModel.load(args.cost_model) if args.cost_model else MEASURED
    if args.cost_model_scale != 1.0:
        cost = cost.scaled(args.cost_model_scale)
    replica = ReplicaConfig(
        replica_id=name, model_name=name, model_dir=str(model_dir),
        scheduler=SchedulerConfig(**values["replica.scheduler"]),
        grammar=GrammarConfig(**values["replica.grammar"]), adapters=adapters,
        cost_model=cost if replica_values["executor"] == "cost-model" else None,
        telemetry=TelemetryConfig.from_env(os.environ), **replica_values)
    # -vv: the router logs each routing decision (candidates' matches and loads) too
    log_level = "DEBUG" if getattr(args, "verbose", 0) >= 2 else "INFO"
    router = RouterConfig(log_level=log_level, **values["router"])
    autoscale = autoscale_config(args)
    replicas = autoscale.targets.min_replicas if autoscale else args.replicas
    if replicas is None:
        replicas = declared_default("replicas")
    return ClusterConfig(replica, router, replicas=replicas, autoscale=autoscale, **values[""])


_TARGET_FLAGS = (("slo_ttft_ms", "--slo-ttft-ms"), ("slo_itl_ms", "--slo-itl-ms"),
                 ("target_kv_utilisation", "--target-kv-utilisation"),
                 ("target_load", "--target-load"), ("upscale_delay_s", "--upscale-delay"),
                 ("downscale_delay_s", "--downscale-delay"))


def autoscale_config(args: argparse.Namespace) -> Optional[AutoscaleConfig]:
    """``--autoscale`` and its targets as an AutoscaleConfig (None without ``--autoscale``).
    Raises ValueError naming the flag: ``--replicas`` beside it, a target flag without it,
    MIN > MAX, an SLO <= 0 (kvfleet.worker.replica.autoscale.AutoscaleTargets)."""
    given = [flag for name, flag in _TARGET_FLAGS if getattr(args, name, None) is not None]
    if getattr(args, "autoscale", None) is None:
        if given:
            raise ValueError(f"{given[0]} needs --autoscale MIN..MAX")
        return None
    if getattr(args, "replicas", None) is not None:
        raise ValueError("--replicas and --autoscale exclude each other: the autoscaler sets "
                         "the count (it starts at MIN)")
    lo, hi = args.autoscale
    ms = lambda v: None if v is None else v / 1000.0  # noqa: E731
    load = getattr(args, "target_load", None)
    extra = {} if load is None else {"target_load": load}
    targets = AutoscaleTargets(lo, hi, slo_ttft_s=ms(args.slo_ttft_ms),
                               slo_itl_s=ms(args.slo_itl_ms),
                               target_kv_utilisation=args.target_kv_utilisation, **extra)
    delays = {k: getattr(args, k) for k in ("upscale_delay_s", "downscale_delay_s")
              if getattr(args, k) is not None}
    return AutoscaleConfig(targets, **delays)


def _check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch sees no CUDA device "
                             f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")


def _checked_adapters(args: argparse.Namespace, model_dir: Path, max_lora_rank: int
                      ) -> tuple[tuple[str, str], ...]:
    """``--adapter`` / ``--adapter-dir`` as (name, dir) pairs, each checked against the model
    before anything starts. Raises ValueError (AdapterError) naming the adapter, file and field."""
    from kvfleet.worker.replica.adapter_catalog import check_catalog, expand_adapter_dirs, parse_adapter_arg
    from kvfleet.worker.runner.model_config import load_model_config

    pairs = expand_adapter_dirs([parse_adapter_arg(a) for a in args.adapter], args.adapter_dir)
    if pairs:
        check_catalog(pairs, load_model_config(model_dir), max_lora_rank)
    return pairs
