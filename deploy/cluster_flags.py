"""``kvfleet up`` / ``demo``'s cluster flags as one table (kvfleet.flag_table), grouped by the
config that owns each flag: the cluster's own (ClusterConfig, and the autoscaler's targets),
the replica's (ReplicaConfig), its scheduler's and grammar cache's (SchedulerConfig,
GrammarConfig) and the router's — those rows are the router's own
(kvfleet.router.flags.ROUTER_FLAGS), set under ``router.`` or, where the router takes the
setting from the replicas (cluster_config.SHARED), on the replica. The parser is built from it
and :func:`cluster_config` assembles the ClusterConfig from it; defaults are the config
dataclasses' own (``{default}`` in a help text shows the declared one). Rules between flags
are the configs' to check (their ``__post_init__``), not the parser's.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Optional

from kvfleet.allocator.units import format_bytes, parse_size
from kvfleet.arg_types import (
    fraction,
    int_in_range,
    int_range,
    non_negative_float,
    positive_float,
    positive_int,
    positive_seconds,
)
from kvfleet.constraint import GrammarConfig
from kvfleet.deploy.autoscale_serve import AutoscaleConfig
from kvfleet.deploy.cluster_config import ClusterConfig, with_default_internal_tls
from kvfleet.deploy.models import DEFAULT_MODEL, resolve_model
from kvfleet.flag_table import Flag, add_flags, by_name, values_by_owner
from kvfleet.flag_table import declared_default as _declared_default
from kvfleet.router.config import RouterConfig
from kvfleet.router.flags import ROUTER_FLAGS
from kvfleet.telemetry import TelemetryConfig
from kvfleet.worker.engine.scheduling.config import LAYER_YIELD_MODES
from kvfleet.worker.engine.scheduling.config import POLICIES as ADMISSION_POLICIES
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.speculative.speculator import MAX_DRAFT_TOKENS
from kvfleet.worker.engine.speculative.speculator import MODES as SPECULATIVE_MODES
from kvfleet.worker.replica.autoscale import AutoscaleTargets
from kvfleet.worker.replica.replica import DEFAULT_KV_MEMORY_BYTES, EXECUTORS, ReplicaConfig
from kvfleet.worker.runner.model_impl import MODEL_IMPLS

# Config path prefix -> the dataclass holding the fields below it ("" = ClusterConfig).
OWNERS: dict[str, type] = {"": ClusterConfig, "replica": ReplicaConfig, "router": RouterConfig,
                           "replica.scheduler": SchedulerConfig, "replica.grammar": GrammarConfig,
                           "router.policy_options": dict}
_ROUTER = by_name(ROUTER_FLAGS)
# The routing policy's knobs (RouterConfig.policy_options), as the router takes them.
POLICY_KNOBS = tuple(f.flag for f in ROUTER_FLAGS if (f.field or "").startswith("policy_options."))
_REPLICAS_DEFAULT = ClusterConfig.__dataclass_fields__["replicas"].default

# The cluster's own: how many replicas, where, and the autoscaler's targets.
CLUSTER_FLAGS: tuple[Flag, ...] = (
    Flag("--replicas", None, f"worker replicas (default {_REPLICAS_DEFAULT}; not with "
         "--autoscale)", "fleet", dest="replicas", type=int, default=None),
    Flag("--autoscale", None, "let Ray Serve scale the replicas between MIN and MAX with "
         "kvfleet's policy (targets: --slo-ttft-ms, --slo-itl-ms, --target-kv-utilisation)",
         "fleet", dest="autoscale", type=int_range("--autoscale"), default=None,
         metavar="MIN..MAX"),
    Flag("--slo-ttft-ms", None, "autoscale: time-to-first-token SLO (ms) that the predicted "
         "queue delay and the replicas' TTFT p90 are held under", "fleet", dest="slo_ttft_ms",
         type=float, default=None),
    Flag("--slo-itl-ms", None, "autoscale: inter-token latency SLO (ms) the replicas' ITL p90 "
         "is held under", "fleet", dest="slo_itl_ms", type=float, default=None),
    Flag("--target-kv-utilisation", None, "autoscale: KV-block utilisation (0..1] to hold the "
         "replicas' mean under", "fleet", dest="target_kv_utilisation", type=float, default=None),
    Flag("--target-load", None, "autoscale: share (0..1] of each replica's decode throughput "
         "to run at; the rest absorbs bursts shorter than a replica's start (default %g)"
         % AutoscaleTargets.target_load, "fleet", dest="target_load", type=float, default=None),
    Flag("--upscale-delay", None, "autoscale: seconds a scale-up decision must persist before "
         "Serve applies it (default %g)" % AutoscaleConfig.upscale_delay_s, "fleet",
         dest="upscale_delay_s", type=float, default=None),
    Flag("--downscale-delay", None, "autoscale: seconds the margin must hold before Serve "
         "removes a replica (default %g)" % AutoscaleConfig.downscale_delay_s, "fleet",
         dest="downscale_delay_s", type=float, default=None),
    Flag("--ray-address", "ray_address", "join this Ray cluster instead of starting one",
         "fleet"),
    Flag("--replicas-per-process", "replicas_per_host",
         "cost-model replicas one process hosts (default {default}: each fails alone; more "
         "are cheaper, but a process that dies takes all of its replicas with it)", "fleet",
         type=positive_int("--replicas-per-process")),
    Flag("--reserved-cpus", "reserved_cpus",
         "whole CPUs of this host kept out of the local replicas' torch threads, for the "
         "router, the token relay and the OS (default {default}; threads per replica = the "
         "rest over the replicas, at least 1)", "fleet",
         type=int_in_range("--reserved-cpus", 0, 4096)),
    _ROUTER["--metrics-port"].at(
        "metrics_port", help="Prometheus metrics: the router on this port, each replica on a "
        "free one (0 = free ports). Traces and OTLP metrics follow OTEL_* variables, e.g. "
        "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317"),
)

# The replicas': the model and how it runs, the KV cache, the lifecycle.
REPLICA_FLAGS: tuple[Flag, ...] = (
    Flag("--model", None, "served model name or HF-format directory (default {default})",
         "model", dest="model", default=DEFAULT_MODEL),
    Flag("--tp", "replica.tensor_parallel_size",
         "tensor-parallel ranks per replica (default {default}): each rank holds 1/T of the "
         "projections and of the KV heads; --num-blocks/--kv-memory are per rank", "model",
         type=positive_int("--tp")),
    Flag("--device", "replica.device",
         "cuda: one GPU per rank, NCCL between ranks (default {default}, gloo)", "model",
         choices=("cpu", "cuda")),
    Flag("--model-impl", "replica.model_impl",
         "native: a registered family's module; transformers: the Hugging Face class itself "
         "behind kvfleet's paged attention (the transformers extra; no layer yield, float "
         "weights, TP by the class's base_model_tp_plan); auto: native when the family is "
         "registered, else transformers (default {default})", "model", choices=MODEL_IMPLS),
    _ROUTER["--quantization"].at("replica.quantization"),
    _ROUTER["--quant-group-size"].at("replica.quant_group_size"),
    Flag("--no-one-row-weights", "replica.one_row_weights",
         "hold each weight once: halves weight memory, slower small-batch decode (default: a "
         "second copy streams faster for steps of a few rows)", "model", action="store_false"),
    Flag("--executor", "replica.executor",
         "model: the real forward; cost-model: a timed stand-in for the forward only "
         "(scheduler, KV cache, index, gRPC stay real)", "model", choices=EXECUTORS),
    Flag("--cost-model", None, "calibration JSON for --executor cost-model (default: the "
         "constants measured on the default model by bench/engine/calibrate.py)", "model",
         dest="cost_model", default=None, metavar="FILE"),
    Flag("--cost-model-scale", None, "multiply the cost model's step times (e.g. 0.05 = 20x "
         "faster)", "model", dest="cost_model_scale", type=float, default=1.0),
    Flag("--adapter", None, "serve the PEFT LoRA adapter in DIR as NAME (repeatable)", "model",
         dest="adapter", action="append", default=[], metavar="NAME=DIR"),
    Flag("--adapter-dir", None, "serve every adapter subdirectory of DIR, named by it "
         "(repeatable)", "model", dest="adapter_dir", action="append", default=[], metavar="DIR"),
    Flag("--max-loras", "replica.max_loras", "LoRA adapter slots per replica, LRU (default "
         "{default})", "model", type=positive_int("--max-loras")),
    Flag("--max-lora-rank", "replica.max_lora_rank", "largest adapter rank accepted (default "
         "{default})", "model", type=positive_int("--max-lora-rank")),
    _ROUTER["--block-size"].at("replica.block_size", help="tokens per KV block (default "
                               "{default})", always=False),
    Flag("--num-blocks", "replica.num_blocks", "KV blocks per replica (on every rank; not with "
         "--kv-memory)", "cache", type=int),
    Flag("--kv-memory", "replica.kv_memory_bytes",
         f"KV memory per replica rank, e.g. 256MiB (default "
         f"{format_bytes(DEFAULT_KV_MEMORY_BYTES).replace(' ', '')})", "cache", type=str,
         convert=lambda text: parse_size(text, "--kv-memory")),
    Flag("--kv-host-memory", "replica.kv_host_memory_bytes",
         "host KV tier per node, e.g. 1GiB (default: none): evicted blocks are written back "
         "there and restored on a prefix hit; shared by the node's replicas, LRU", "cache",
         type=str, convert=lambda text: parse_size(text, "--kv-host-memory")),
    Flag("--no-kv-peer-pull", "replica.kv_peer_pull",
         "never pull a prefix the router says another replica holds (default: with "
         "--kv-host-memory, pull it through the node tier when that beats recomputing it)",
         "cache", action="store_false"),
    Flag("--no-kv-hand-over", "replica.kv_hand_over",
         "a draining replica drops its cached blocks (default: with --kv-host-memory, it "
         "writes its hottest blocks back to the node tier first, within its drain timeout)",
         "cache", action="store_false"),
    Flag("--kv-write-back-queue", "replica.kv_write_back_queue_bytes",
         "with --kv-host-memory: write-back bytes each rank queues for the node tier at once, "
         "e.g. 64MiB (default {default}); what does not fit is dropped (counted), the step "
         "never waits; a drain hands over in turns of it", "cache", type=str,
         convert=lambda text: parse_size(text, "--kv-write-back-queue"),
         show=lambda v: format_bytes(v).replace(" ", "")),
    Flag("--kv-write-back-run", "replica.kv_write_back_run_bytes",
         "with --kv-host-memory: the most bytes one put into the node tier carries (a run "
         "of blocks; default {default}); a larger write-back goes as several", "cache",
         type=str, convert=lambda text: parse_size(text, "--kv-write-back-run"),
         show=lambda v: format_bytes(v).replace(" ", "")),
    Flag("--kv-prewarm-s", "replica.kv_prewarm_s",
         "with --kv-host-memory: a new replica first restores its node tier's most recently "
         "used blocks of its model into its pool, for at most this many seconds before it "
         "serves (default {default}: off; its first hits then restore at admission)", "cache",
         type=non_negative_float("--kv-prewarm-s"), metavar="SECONDS"),
    _ROUTER["--redis-url"].at("replica.redis_url", help="use this Redis instead of starting a "
                              "private one", required=False, always=False, show=None),
    Flag("--replica-host", "replica.host",
         "interface the replicas serve gRPC on (default {default}; 0.0.0.0 on a cluster spanning "
         "hosts: each replica registers its node's address)", "fleet"),
    Flag("--drain-timeout", "replica.drain_timeout_s",
         "seconds a stopping replica (scale-down, upgrade, Ctrl-C) waits for its streams before "
         "ending them UNAVAILABLE (default {default})", "fleet", type=positive_seconds),
    Flag("--adapter-root", "replica.adapter_roots",
         "`kvfleet adapter load` may read adapters under DIR (repeatable; the --adapter and "
         "--adapter-dir directories are allowed too; any other path is refused "
         "PERMISSION_DENIED)", "security", action="append", default=[], metavar="DIR",
         convert=tuple),
    _ROUTER["--internal-tls-dir"].at(
        "replica.internal_tls_dir", help="mutual TLS between router and workers with this "
        "directory's cluster CA (generated there when empty; default: off on loopback, "
        "~/.kvfleet/internal-tls beyond it)"),
)

# The replicas' scheduler and grammar cache.
SCHEDULER_FLAGS: tuple[Flag, ...] = (
    Flag("--admission", "replica.scheduler.policy", "worker admission policy (default "
         "{default})", "scheduling", choices=tuple(ADMISSION_POLICIES)),
    Flag("--max-num-seqs", "replica.scheduler.max_num_seqs",
         "sequences a replica runs at once (default {default})", "scheduling", type=int),
    Flag("--max-num-batched-tokens", "replica.scheduler.max_num_batched_tokens",
         "tokens one engine step computes (default {default})", "scheduling", type=int),
    Flag("--max-queue-wait-s", "replica.max_queue_wait_s",
         "a replica refuses (RESOURCE_EXHAUSTED, at once) a request it predicts would wait "
         "longer than this before its prefill starts, and advertises the bound (default "
         "{default} s)", "scheduling", type=positive_seconds),
    Flag("--itl-target-ms", "replica.scheduler.itl_target_ms",
         "inter-token latency target: a step takes prefill tokens only while its predicted time "
         "(the replica's calibrated step-cost model) stays under it; a waiting prompt still "
         "advances every step (default: off, the token budget alone)", "scheduling",
         type=positive_float("--itl-target-ms"), metavar="MS"),
    Flag("--tenant-share", "replica.scheduler.tenant_share",
         "fraction of a replica's running + waiting slots one tenant may hold (default "
         "{default}: no per-tenant cap)", "scheduling", type=fraction("--tenant-share")),
    Flag("--batch-share", "replica.scheduler.batch_share",
         "fraction of a replica's running slots the batch priority class may hold (default "
         "{default}: no cap)", "scheduling", type=fraction("--batch-share")),
    Flag("--class-headroom", "replica.scheduler.class_headroom",
         "running slots a better priority class may take past --max-num-seqs beside a lower "
         "class, which never count against the lower one (an interactive trickle adds its rows "
         "to a batch flood's steps instead of taking its slots; default: an eighth of "
         "--max-num-seqs, at least 1; 0: none, a better class takes a lower one's slot)",
         "scheduling", type=int_in_range("--class-headroom", 0, 1 << 20), metavar="N"),
    Flag("--layer-yield", "replica.scheduler.layer_yield",
         "a step in flight pauses between decoder layers for a nested step of newly arrived "
         "higher-class prompts (interactive TTFT beside a batch flood): on, off, or auto = on "
         "once the replica has taken requests of more than one priority (default {default})",
         "scheduling", choices=LAYER_YIELD_MODES),
    Flag("--speculative", "replica.scheduler.speculative",
         "speculative decoding, drafts verified in the batch (the answer never changes): ngram "
         "copies from the request's own prompt and output, suffix also from recent outputs of "
         "the same cache scope; each row's draft length follows its acceptance and the "
         "step-cost model (default {default})", "scheduling", choices=SPECULATIVE_MODES),
    Flag("--speculative-tokens", "replica.scheduler.speculative_tokens",
         "speculative decoding: drafts per decode row per step at most, 1 to "
         f"{MAX_DRAFT_TOKENS} (default {{default}})", "scheduling",
         type=int_in_range("--speculative-tokens", 1, MAX_DRAFT_TOKENS)),
    Flag("--max-grammar-compile-s", "replica.grammar.max_compile_s",
         "structured output: a schema, regex or grammar whose compile takes longer is refused "
         "with INVALID_ARGUMENT, and so is that constraint from then on; a compile also waits "
         "at most this long for a thread, then RESOURCE_EXHAUSTED (default {default} s)",
         "scheduling", type=positive_seconds),
    Flag("--grammar-cache-size", "replica.grammar.cache_size",
         "compiled grammars kept per replica, LRU (default {default})", "scheduling",
         type=positive_int("--grammar-cache-size")),
    Flag("--grammar-threads", "replica.grammar.threads",
         "structured output: compile threads per replica (default {default})", "scheduling",
         type=positive_int("--grammar-threads")),
    Flag("--grammar-tenant-compiles", "replica.grammar.tenant_compiles",
         "structured output: compiles one tenant may run at once on a replica, at most "
         "--grammar-threads (default {default}: one tenant's slow schemas leave the other "
         "threads to the others)", "scheduling",
         type=positive_int("--grammar-tenant-compiles")),
    Flag("--grammar-queue", "replica.grammar.max_queued",
         "structured output: compiles one tenant may have waiting for a thread; past it its "
         "new schemas are refused RESOURCE_EXHAUSTED (default {default})", "scheduling",
         type=int),
    Flag("--grammar-mask-budget-ms", "replica.grammar.mask_budget_ms",
         "structured output: CPU ms one row's token mask may take in a step; a request past "
         "it ends INVALID_ARGUMENT and its constraint is refused from then on (default "
         "{default})", "scheduling", type=positive_float("--grammar-mask-budget-ms"),
         metavar="MS"),
)

# The router's own rows, under ``router.``; ``--http-port`` is on by default here.
UP_ROUTER_FLAGS: tuple[Flag, ...] = (
    *(_ROUTER[name].at("router." + (_ROUTER[name].field or ""), always=False)
      for name in ("--policy", "--no-index-mirror", *POLICY_KNOBS, "--priority-admit",
                   "--tenant-max-inflight", "--port", "--api-keys", "--tls-cert", "--tls-key")),
    _ROUTER["--http-port"].at(
        "router.http_port", help="the router's OpenAI-compatible HTTP API (default {default}; "
        "0 = a free port, -1 = off)", default=8000, only=("up",),
        convert=lambda port: None if port < 0 else port),
)

FLAGS: tuple[Flag, ...] = CLUSTER_FLAGS + REPLICA_FLAGS + SCHEDULER_FLAGS + UP_ROUTER_FLAGS


def declared_default(path: str) -> Any:
    """The default ``path``'s dataclass declares for it (``"replica.block_size"`` → 16)."""
    return _declared_default(OWNERS, path)


# The flags `kvfleet k8s render` takes from this table too (its other flags are its own).
AUTOSCALE_FLAGS = ("--autoscale", "--slo-ttft-ms", "--slo-itl-ms", "--target-kv-utilisation",
                   "--target-load", "--upscale-delay", "--downscale-delay")


def add_cluster_args(p: argparse.ArgumentParser, command: str,
                     names: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """Add :data:`FLAGS` (those ``command`` takes; only ``names`` when given) to ``p``, in
    their ``--help`` sections. Returns the sections (a command adds its own flags to them)."""
    rows = [f for f in FLAGS if names is None or f.flag in names]
    return add_flags(p, rows, command, lambda f: declared_default(f.field) if f.field else None)


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """Build a ClusterConfig from parsed args (of :func:`add_cluster_args`' flags), checking
    what can be checked before anything starts (the model's family and config fields among
    them). Raises ModelNotPrepared / ValueError (UnsupportedModel, ConfigError)."""
    from kvfleet.worker.executor.cost_model import MEASURED, CostModel
    from kvfleet.worker.replica.adapter_catalog import adapter_roots
    from kvfleet.worker.runner.fallback.check import FallbackRequest
    from kvfleet.worker.runner.models import check_model_dir

    name, model_dir = resolve_model(args.model)
    values = values_by_owner(args, FLAGS, OWNERS)
    # Beyond loopback: mutual TLS by default (~/.kvfleet/internal-tls), never plaintext.
    replica_values = with_default_internal_tls(values["replica"])
    # An unsupported family or field, or what the fallback cannot do: refused before Ray.
    model = check_model_dir(model_dir, replica_values["model_impl"], FallbackRequest(
        replica_values["tensor_parallel_size"], replica_values["quantization"],
        values["replica.scheduler"]["layer_yield"] == "on"))
    _check_device(replica_values["device"])
    if replica_values["tensor_parallel_size"] != 1 and model.impl == "native":
        from kvfleet.worker.runner.tp.layout import check_tp

        check_tp(model, replica_values["tensor_parallel_size"])
    if replica_values["quantization"] != "none" and model.impl == "native":
        from kvfleet.worker.runner.quant.checkpoint import read_format
        from kvfleet.worker.runner.quant.shard import check_quant_groups

        check_quant_groups(model, replica_values["quant_group_size"],
                           replica_values["tensor_parallel_size"],
                           own_groups=read_format(model_dir) is not None)
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
    knobs = {k: v for k, v in values["router.policy_options"].items() if v is not None}
    router = RouterConfig(log_level=log_level, policy_options=knobs, **values["router"])
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
