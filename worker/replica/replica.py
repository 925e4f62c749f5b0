"""One model replica: builds the engine from a model directory, serves it over gRPC on a free
loopback port, registers in Redis, publishes KV events and heartbeats with load.

:class:`ReplicaServer` is plain asyncio (usable in-process in tests);
:mod:`kvfleet.worker.replica.serve_deployment` hosts it as a Ray Serve replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import grpc
import tokenizers
import torch

from kvfleet.allocator.fingerprint import fingerprint_model_dir, served_weights
from kvfleet.allocator.hashing import CacheIdentity
from kvfleet.allocator.kv_bytes import kv_heads_per_rank
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.constraint import GrammarConfig
from kvfleet.errors import Unavailable
from kvfleet.grpc_auth import AuthInterceptor, internal_authorizer
from kvfleet.grpc_util import (
    SERVER_OPTIONS,
    add_health_and_reflection,
    advertised_host,
    bind_port,
    mark_serving,
)
from kvfleet.index_keys import REDIS_DOWN_ERRORS, ReplicaInfo, ReplicaLoad
from kvfleet.stream_limits import StreamLimits
from kvfleet.telemetry import Telemetry, TelemetryConfig
from kvfleet.telemetry.worker_spans import WorkerTelemetry
from kvfleet.tls import (
    REPLICA_NAME,
    ROUTER_NAME,
    needs_internal_tls,
    reloading_worker_credentials,
)
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.base import Executor, RankInfo
from kvfleet.worker.executor.cost_model import CostModel, cost_model_executor
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.executor.tp.group import RankGroup, TPSettings
from kvfleet.worker.executor.tp.rank_worker import RankSpec
from kvfleet.worker.executor.tp_executor import TPExecutor
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.node_tier import TierIndex, node_tier
from kvfleet.worker.kv_tier.peer_client import PEER_METHODS
from kvfleet.worker.kv_tier.prewarm import prewarm_before_serving
from kvfleet.worker.kv_tier.rank_tier import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_RUN_BYTES,
    RankTier,
)
from kvfleet.worker.kv_tier.tier_layout import LayoutTier, TierLayout
from kvfleet.worker.replica.adapter_admin import AdapterAdmin
from kvfleet.worker.replica.adapter_catalog import check_catalog
from kvfleet.worker.replica.adapter_record import AdapterRecord
from kvfleet.worker.replica.hit_window import HitWindow
from kvfleet.worker.replica.kv_publisher import KvPublisher
from kvfleet.worker.replica.load_report import LatencyWindow, replica_report
from kvfleet.worker.replica.peer_setup import build_puller
from kvfleet.worker.replica.shared_calibration import shared_or_calibrate
from kvfleet.worker.runner.kv_cache import num_blocks_for_memory
from kvfleet.worker.runner.memory import trim_heap
from kvfleet.worker.runner.model_config import ModelConfig, load_model_config
from kvfleet.worker.runner.model_impl import MODEL_IMPLS, TRANSFORMERS
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant.config import DEFAULT_GROUP_SIZE, FLOAT_WEIGHTS, QuantConfig
from kvfleet.worker.service.engine_loop import EngineLoop
from kvfleet.worker.service.server import WorkerService
from kvfleet.worker.step_cost.calibration import CalibrationKey, device_name, load_or_calibrate
from kvfleet.worker.step_cost.model import MEASURED, StepCost

log = logging.getLogger(__name__)


def _on_finish(telemetry: WorkerTelemetry, hits: HitWindow, latency: LatencyWindow,
               out: SeqOutput) -> None:
    """A sequence finished: its metrics, the prefix-hit and the latency windows."""
    telemetry.on_finished(out)
    hits.record(out)
    latency.record(out)


def _node_tier(cfg: ReplicaConfig, mc: ModelConfig, groups: LayerGroups) -> LayoutTier:
    """The deployment's tier on this node (its namespace's actor; index URL without the
    password), seen through this replica's layout: its ranks' KV-head shards of its layer
    groups' pages."""
    assert cfg.kv_host_memory_bytes
    tp = cfg.tensor_parallel_size
    index = TierIndex.of(cfg.redis_url, cfg.namespace) if cfg.redis_url else None
    layout = TierLayout(tp, kv_heads_per_rank(mc.num_kv_heads, mc.num_heads, tp),
                        groups.layout_key)
    return LayoutTier(node_tier(cfg.kv_host_memory_bytes, index=index,
                                namespace=cfg.namespace), layout)


def worker_interceptors(mutual_tls: bool) -> list[AuthInterceptor]:
    """The Worker server's interceptors: every method (``ExportBlocks`` included) authorised
    as :func:`internal_authorizer` says: the router's certificate anything, a replica's
    certificate the peer methods only."""
    return [AuthInterceptor(internal_authorizer(mutual_tls, ROUTER_NAME,
                                                {REPLICA_NAME: PEER_METHODS}))]


def _kv_tier_id(engine: Engine) -> str:
    """The index's name of the node tier the engine restores from ("" without one)."""
    return engine.scheduler.tier.tier_id


def _advertised(seconds: float) -> float:
    """A bound as the registry carries it (0: none)."""
    return seconds if seconds < float("inf") else 0.0


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_MEMORY_BYTES = 256 << 20  # 256 MiB of K/V per replica unless told otherwise
EXECUTORS = ("model", "cost-model")
STOP_TASKS_TIMEOUT_S = 2.0  # how long stop() waits for its cancelled background tasks


@dataclass(frozen=True)
class ReplicaConfig:
    """How to build and serve one replica of ``tensor_parallel_size`` ranks.

    Exactly one of ``num_blocks`` / ``kv_memory_bytes`` sizes the KV pool; with neither,
    ``DEFAULT_KV_MEMORY_BYTES`` is used. Both are per rank: every rank holds ``num_blocks``
    blocks of its own KV heads (``kvfleet budget --tp`` gives the per-rank bytes).
    """

    replica_id: str
    model_name: str
    model_dir: str
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_memory_bytes: Optional[int] = None
    # The node's host KV tier (kvfleet.worker.kv_tier), bytes per node; None: no tier.
    kv_host_memory_bytes: Optional[int] = None
    # Pull a prefix the router says a peer holds when that beats recomputing it (needs the
    # host tier, which the blocks travel through).
    kv_peer_pull: bool = True
    # On a drain, write the hottest cached blocks back to the node's tier before deregistering
    # (needs the host tier). False: they are dropped with the pool.
    kv_hand_over: bool = True
    # Before serving, restore the node tier's hottest blocks of this identity into the pool
    # for at most this long (0: off; needs the host tier).
    kv_prewarm_s: float = 0.0
    # Write-back bytes each rank queues for the host tier at once (what does not fit is
    # dropped, counted), and the bytes of one put into it (a run of blocks).
    kv_write_back_queue_bytes: int = DEFAULT_MAX_PENDING_BYTES
    kv_write_back_run_bytes: int = DEFAULT_MAX_RUN_BYTES
    dtype: str = "float32"
    # A second copy of each weight for steps of a few rows (worker/runner/models/linear.py):
    # lower small-batch and verify-step ITL on CPU for twice the weight memory (docs/benchmarks.md, Engine).
    one_row_weights: bool = True
    # Weight-only quantization of every projection, the embedding and the LM head
    # (kvfleet.worker.runner.quant): "none", "int8" or "int4", groups of quant_group_size
    # inputs when quantized at load; part of the cache identity.
    quantization: str = "none"
    quant_group_size: int = DEFAULT_GROUP_SIZE
    # Which implementation runs the model (kvfleet.worker.runner.model_impl): "native" (a
    # registered family), "transformers" (the Hugging Face class behind the paged attention,
    # kvfleet.worker.runner.fallback) or "auto" (native when registered).
    model_impl: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    redis_url: Optional[str] = None
    namespace: str = "kvfleet:"
    host: str = "127.0.0.1"
    port: int = 0
    num_threads: int = 1
    heartbeat_interval_s: float = 1.0
    replica_ttl_s: float = 10.0
    block_ttl_s: Optional[float] = None  # safety-net TTL on the index's block keys (None: none)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # OTLP / Prometheus
    # "model" runs the real forward; "cost-model" replaces only the forward with a timed
    # stand-in (kvfleet.worker.executor.cost_model) — scheduler, block pool, KV events stay real.
    executor: str = "model"
    cost_model: Optional[CostModel] = None  # constants for "cost-model" (default: measured ones)
    # Ranks 1..T-1 are Ray actors (kvfleet.worker.executor.tp); one thread per rank when T > 1.
    tensor_parallel_size: int = 1
    tp: TPSettings = field(default_factory=TPSettings)
    device: str = "cpu"  # "cuda": one GPU per rank (NCCL), as Ray assigns them
    # Mutual TLS: serve with the cluster's worker certificate and require a client certificate
    # signed by its CA (kvfleet.tls); None = plaintext.
    internal_tls_dir: Optional[str] = None
    # Slow or vanished readers: outputs buffered per stream, seconds a write may wait.
    stream_limits: StreamLimits = field(default_factory=StreamLimits)
    # Structured output: compile-time bound and cache size (kvfleet.worker.engine.output.grammar).
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    # LoRA: servable adapters as (name, directory), checked at start; max_loras slots per
    # replica (LRU, loaded on first use), max_lora_rank the largest rank accepted.
    adapters: tuple[tuple[str, str], ...] = ()
    # The only directories a runtime LoadAdapter may read from (adapter_catalog.adapter_roots).
    adapter_roots: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 64
    # The Ray Serve replica hosting this one ("" outside Serve), written to the registry.
    serve_replica: str = ""
    # A drain (scale-down, Worker.Drain, SIGTERM) waits this long for in-flight streams, then
    # ends the rest UNAVAILABLE naming the drain.
    drain_timeout_s: float = 30.0
    # The step-cost model's start-up calibration (kvfleet.worker.step_cost.calibration):
    # cached here per model/device/tp/dtype/threads (None: <kvfleet cache dir>/step_cost;
    # "" = never cached), measured for about calibration_budget_s seconds when not cached.
    step_cost_dir: Optional[str] = None
    calibration_budget_s: float = 20.0
    # A request predicted to wait longer than this before its prefill starts is refused at
    # once (RESOURCE_EXHAUSTED), never queued (worker/service/wait_bound.py); advertised in
    # the registry. inf: no bound in seconds (the sequence count alone).
    max_queue_wait_s: float = 60.0

    @property
    def quant_config(self) -> QuantConfig:
        """``quantization`` and ``quant_group_size`` as the runner takes them.

        Raises:
            ValueError: an unknown method or a bad group size (naming the field).
        """
        return QuantConfig(self.quantization, self.quant_group_size)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        if not 0 <= self.kv_prewarm_s < float("inf"):
            raise ValueError(f"kv_prewarm_s must be >= 0 and finite, got {self.kv_prewarm_s}")
        if self.kv_write_back_queue_bytes < 0 or self.kv_write_back_run_bytes <= 0:
            raise ValueError(f"kv_write_back_queue_bytes must be >= 0 and kv_write_back_run_bytes "
                             f"> 0, got {self.kv_write_back_queue_bytes} and "
                             f"{self.kv_write_back_run_bytes}")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")
        if not self.calibration_budget_s > 0:
            raise ValueError(f"calibration_budget_s must be > 0, got {self.calibration_budget_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("num_blocks (--num-blocks) and kv_memory_bytes (--kv-memory) "
                             "exclude each other: each sizes the KV pool")
        if self.tensor_parallel_size > 1 and self.executor != "model":
            raise ValueError("tensor_parallel_size > 1 needs the model executor")
        if self.scheduler.layer_yield and self.tensor_parallel_size > 1:
            raise ValueError("scheduler.layer_yield (--layer-yield) needs tensor_parallel_size 1 "
                             "(a forward pauses between layers only in one process)")
        QuantConfig(self.quantization, self.quant_group_size)  # ValueError naming the field
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got "
                             f"{self.model_impl!r}")
        if self.scheduler.layer_yield and self.kv_host_memory_bytes:
            raise ValueError("scheduler.layer_yield (--layer-yield) does not run beside a host KV "
                             "tier (kv_host_memory_bytes, --kv-host-memory): its forward cannot "
                             "pause; choose one")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if needs_internal_tls(self.host) and not self.internal_tls_dir:
            # Fail closed: beyond loopback anyone reaching the port could call Generate,
            # LoadAdapter, Drain or Abort; never serve that in plaintext.
            raise ValueError(f"host {self.host!r} is reachable from other hosts: replicas bound "
                             f"beyond loopback serve mutual TLS only; set internal_tls_dir "
                             f"(--internal-tls-dir)")


def cache_identity(model_name: str, model_dir: str | Path, kv_dtype: str, block_size: int,
                   quant: QuantConfig = FLOAT_WEIGHTS) -> CacheIdentity:
    """The identity both router and worker derive from the same model directory and weight
    quantization (docs/design.md §2)."""
    fp = fingerprint_model_dir(model_dir)
    return CacheIdentity(model=model_name,
                         weights_fingerprint=served_weights(fp.weights, quant.method, quant.group_size),
                         tokenizer_fingerprint=fp.tokenizer,
                         chat_template_fingerprint=fp.chat_template,
                         kv_dtype=kv_dtype, block_size=block_size)


def kv_layer_groups(cfg: ReplicaConfig, mc: ModelConfig) -> LayerGroups:
    """The KV cache's layer groups: by window when some layer slides (window-sized KV), one
    group of every layer otherwise, for the cost-model executor (it keeps no KV) and for the
    transformers fallback (its attention reads one block table). The host KV tier and peer
    pulls move each group's pages under the group layout (:attr:`LayerGroups.layout_key`)."""
    if (cfg.executor != "model" or mc.impl == TRANSFORMERS
            or all(w is None for w in mc.sliding_windows)):
        return LayerGroups.single(mc.num_layers)
    return LayerGroups.from_windows(mc.sliding_windows)


def build_engine(cfg: ReplicaConfig, on_rank_failure: Callable[[str], None] = lambda msg: None
                 ) -> Engine:
    """Load the model (with tp > 1: start ranks 1..T-1 and take rank 0's shard) and size the
    KV pool. ``on_rank_failure`` is called once, from any thread, when a rank dies or hangs.

    Raises:
        FileNotFoundError: a bad model dir.
        ShardingError: the model's heads do not split over ``tensor_parallel_size``.
    """
    tp = cfg.tensor_parallel_size
    catalog = check_catalog(cfg.adapters, load_model_config(cfg.model_dir, cfg.model_impl),
                            cfg.max_lora_rank)
    max_loras = cfg.max_loras if cfg.executor == "model" else 0
    torch.set_num_threads(cfg.num_threads if tp == 1 else 1)
    dtype = DTYPES[cfg.dtype]
    model_dir = Path(cfg.model_dir)
    num_blocks = cfg.num_blocks
    groups = kv_layer_groups(cfg, load_model_config(model_dir, cfg.model_impl))
    if num_blocks is None:
        mc = load_model_config(model_dir, cfg.model_impl)
        kv_tp = tp
        if mc.impl == "transformers":  # its plan may keep every KV head on every rank
            from kvfleet.worker.runner.fallback.check import kv_split

            kv_tp = kv_split(model_dir, mc, tp)
        num_blocks = num_blocks_for_memory(mc, cfg.block_size, dtype,
                                           cfg.kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES, kv_tp,
                                           groups)
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # The node's host tier (Ray: the replica runs in it); the cost model has no KV to keep.
    tier = (_node_tier(cfg, load_model_config(model_dir, cfg.model_impl), groups)
            if cfg.kv_host_memory_bytes and cfg.executor == "model" else None)
    identity = cache_identity(cfg.model_name, model_dir, cfg.dtype, cfg.block_size, cfg.quant_config)
    if cfg.executor == "cost-model":
        executor: Executor = cost_model_executor(load_model_config(model_dir, cfg.model_impl),
                                                 tokenizer,
                                                 num_blocks, cfg.block_size, cfg.cost_model)
    elif tp > 1:
        spec = RankSpec(str(model_dir), tp, num_blocks, cfg.block_size, dtype,
                        cfg.one_row_weights, cfg.device, max_loras=max_loras, tier=tier,
                        quantization=cfg.quant_config, model_impl=cfg.model_impl,
                        tier_tag=identity.digest(), tier_queue_bytes=cfg.kv_write_back_queue_bytes,
                        tier_run_bytes=cfg.kv_write_back_run_bytes, layer_groups=groups)
        group = RankGroup(spec, cfg.tp, cfg.replica_id, on_rank_failure)
        executor = TPExecutor(group.start(), group)
    else:
        runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=cfg.block_size,
                             dtype=dtype, device=cfg.device, one_row_weights=cfg.one_row_weights,
                             max_loras=max_loras, quantization=cfg.quant_config,
                             model_impl=cfg.model_impl, layer_groups=groups)
        executor = LocalExecutor(runner, RankTier(
            tier, 0, runner.kv_cache, cfg.kv_write_back_queue_bytes, identity.digest(),
            cfg.kv_write_back_run_bytes) if tier else None)
    kv = KVCacheManager(num_blocks, cfg.block_size, windows=groups.windows)
    mc = executor.config
    if catalog and not max_loras:
        raise ValueError("serving adapters needs the model executor and max_loras >= 1")
    residency = AdapterResidency(executor, catalog, max_loras) if max_loras else None
    return Engine(executor, kv, tokenizer, identity.digest(), mc.eos_token_ids,
                  mc.max_position_embeddings, mc.vocab_size, cfg.scheduler,
                  adapters=residency, identity=identity, grammar=cfg.grammar,
                  step_cost=_step_cost(cfg, executor, identity),
                  tier=TierLookup(tier, tp, background=True) if tier else None)


def _step_cost(cfg: ReplicaConfig, executor: Executor, identity: CacheIdentity) -> StepCost:
    """The replica's step-cost model: a cost-model executor's own constants, or the real
    executor's start-up calibration (shared through Redis, else from the disk cache, when
    this model/device/tp/dtype/threads/layer-group layout was calibrated before)."""
    if cfg.executor == "cost-model":
        return StepCost(cfg.cost_model or MEASURED)
    tp = cfg.tensor_parallel_size
    groups = getattr(executor, "layer_groups", None)  # the KV layout its steps run over
    key = CalibrationKey(identity.digest().hex(), device_name(cfg.device), tp, cfg.dtype,
                         cfg.num_threads if tp == 1 else 1,
                         layout=groups.layout_key if groups is not None else "")
    if cfg.step_cost_dir is None:
        from kvfleet.deploy.models import default_cache_dir  # the one kvfleet cache location

        cache: Optional[Path] = default_cache_dir() / "step_cost"
    else:
        cache = Path(cfg.step_cost_dir) if cfg.step_cost_dir else None
    # Another replica of this key (a pod before this one) may have stored its fit in Redis.
    return StepCost(shared_or_calibrate(
        cfg.redis_url, cfg.namespace, key,
        lambda: load_or_calibrate(executor, key, cache, cfg.calibration_budget_s)))


class ReplicaServer:
    """A replica's engine thread + gRPC server + Redis publisher, on one asyncio loop."""

    def __init__(self, cfg: ReplicaConfig, telemetry: Optional[Telemetry] = None) -> None:
        self.cfg = cfg
        self.failure: Optional[str] = None  # set once when a tensor-parallel rank fails
        self._aio_loop: Optional[asyncio.AbstractEventLoop] = None
        self._health = None
        self.engine = build_engine(cfg, self._on_rank_failure)
        self.address: Optional[str] = None
        self.metrics_address: Optional[str] = None  # Prometheus endpoint, when one is served
        self.telemetry = telemetry  # built from cfg.telemetry at start unless given
        self._owns_telemetry = telemetry is None
        self.publisher: Optional[KvPublisher] = None
        self._adapter_record: Optional[AdapterRecord] = None
        self._server: Optional[grpc.aio.Server] = None
        self._loop: Optional[EngineLoop] = None
        self.service: Optional[WorkerService] = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False  # ends the heartbeat loop even where a cancel is swallowed
        self.hits = HitWindow()
        self.latency = LatencyWindow()
        # The queue-delay prediction's step prices: the cost model's calibrated constants.
        self.drained = False  # a drain completed: deregistered, refusing every request
        self.handed_over_blocks = 0  # written to the node's tier by the drain (kv_hand_over)

    async def start(self) -> str:
        """Start serving; returns ``host:port``. Raises OSError if the port is taken."""
        aio_loop = self._aio_loop = asyncio.get_running_loop()
        self._server = grpc.aio.server(options=SERVER_OPTIONS,
                                       interceptors=worker_interceptors(bool(self.cfg.internal_tls_dir)))
        # Follows the directory: a renewed certificate is served from the next handshake on.
        creds = (reloading_worker_credentials(self.cfg.internal_tls_dir)
                 if self.cfg.internal_tls_dir else None)
        port = bind_port(self._server, self.cfg.host, self.cfg.port, creds)
        self.address = f"{advertised_host(self.cfg.host)}:{port}"
        if self.telemetry is None:
            self.telemetry = Telemetry(self.cfg.telemetry, "worker", self.cfg.replica_id)
        self.metrics_address = self.telemetry.metrics_address
        admin = self._adapter_admin()
        if admin is not None and self.cfg.redis_url:
            # Runtime loads/unloads of the model's adapters, before registering: a replica
            # started after them (scale-up, replacement, upgrade) serves what its peers serve.
            admin.record = self._adapter_record = AdapterRecord(
                self.cfg.redis_url, self.cfg.model_name, self.cfg.namespace)
            try:
                await admin.apply_record()
            except REDIS_DOWN_ERRORS as exc:
                log.warning("replica %s: recorded adapter changes unreadable (%s); serving the "
                            "start-time adapters", self.cfg.replica_id, exc)
        if self.cfg.redis_url:
            info = ReplicaInfo(self.cfg.replica_id, self.address, self.cfg.model_name, 0,
                               self.cfg.block_size, max_requests=self.cfg.scheduler.max_sequences,
                               max_queue_wait_s=_advertised(self.cfg.max_queue_wait_s),
                               tensor_parallel_size=self.cfg.tensor_parallel_size,
                               ranks=tuple(dataclasses.asdict(r) for r in self.ranks()),
                               serve_replica=self.cfg.serve_replica,
                               metrics_address=self.metrics_address or "",
                               identity=self.engine.identity_digest.hex(),
                               kv_tier=_kv_tier_id(self.engine), **self.adapter_fields())
            self.publisher = KvPublisher(self.cfg.redis_url, info, namespace=self.cfg.namespace,
                                         replica_ttl_s=self.cfg.replica_ttl_s,
                                         block_ttl_s=self.cfg.block_ttl_s)
        wt = WorkerTelemetry(self.telemetry, self.cfg.replica_id, self.cfg.model_name,
                             stats_fn=lambda: self._loop.stats if self._loop else {},
                             adapters_fn=lambda: self.engine.adapters.catalog if self.engine.adapters else (),
                             step_cost=self.engine.step_cost,  # PullStats, or None:
                             pull_stats_fn=lambda: getattr(self.service and self.service.puller,
                                                           "stats", None))
        self._loop = EngineLoop(self.engine, aio_loop, on_step=self._on_step(aio_loop),
                                on_finish=functools.partial(_on_finish, wt, self.hits, self.latency),
                                max_unread=self.cfg.stream_limits.max_unread)
        service = WorkerService(self._loop, self.cfg.replica_id, self.cfg.model_name,
                                self.cfg.block_size, epoch_fn=self._epoch, telemetry=wt,
                                ranks_fn=self.ranks, drain_fn=self.drain,
                                limits=self.cfg.stream_limits, adapter_admin=admin,
                                puller=build_puller(self.engine, self.cfg.kv_peer_pull,
                                                    self.cfg.internal_tls_dir,
                                                    self.cfg.kv_host_memory_bytes),
                                max_queue_wait_s=self.cfg.max_queue_wait_s)
        self.service = service
        worker_pb2_grpc.add_WorkerServicer_to_server(service, self._server)
        name = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
        health = self._health = add_health_and_reflection(self._server, [name])
        # Before the engine thread starts and the replica registers (bounded: kv_prewarm_s).
        warm = await asyncio.to_thread(prewarm_before_serving, self.engine, self.cfg.kv_prewarm_s)
        self._loop.start()
        await self._server.start()
        await mark_serving(health, [name])
        if self.publisher is not None:
            await self.publisher.register()
            await self.publisher.publish(warm, ())
            self._tasks.append(asyncio.create_task(self._heartbeat()))
        log.info("replica %s serving %s on %s", self.cfg.replica_id, self.cfg.model_name, self.address)
        return self.address

    def ranks(self) -> list[RankInfo]:
        """Every rank of this replica (rank 0 first; one entry at tp=1)."""
        return self.engine.executor.ranks()  # empty for the cost model

    def _on_rank_failure(self, message: str) -> None:
        """A rank died or hung (any thread): refuse and end every stream with UNAVAILABLE
        naming it, health NOT_SERVING, deregister at once. The group has released the ranks."""
        self.failure = message
        if self._loop is not None:
            self._loop.fail(Unavailable(message))
        if self._aio_loop is not None and not self._aio_loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._failed(), self._aio_loop)

    async def _failed(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()
        if self._health is not None:
            name = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
            await mark_serving(self._health, [name], serving=False)
        if self.publisher is not None:
            try:
                await self.publisher.deregister()
            except Exception:
                log.exception("deregister after a rank failure failed")

    def _epoch(self) -> int:
        return getattr(self.publisher, "epoch", 0) if self.publisher else 0

    def _on_step(self, aio_loop: asyncio.AbstractEventLoop):
        def hook(stored: list[bytes], removed: list[bytes], stats: dict) -> None:
            if self.publisher is not None and self.failure is None:  # failed: deregistered
                # Off the engine thread and off the TTFT path: one pipeline per step.
                asyncio.run_coroutine_threadsafe(self.publisher.publish(stored, removed), aio_loop)
        return hook

    def load(self) -> ReplicaLoad:
        s = self._loop.stats if self._loop else self.engine.stats()
        return ReplicaLoad(running=s["running"], waiting=s["waiting"],
                           num_free_blocks=s["num_free_blocks"],
                           num_total_blocks=s["num_total_blocks"], updated_at=time.time(),
                           queue_delay_s=s.get("queue_delay_s"),
                           prefill_token_s=s.get("prefill_token_s"),
                           spec_drafted_tokens=s.get("spec_drafted_tokens"),
                           spec_accepted_tokens=s.get("spec_accepted_tokens"))

    def autoscale_report(self, revision: str = "") -> dict[str, float]:
        """This replica's signals for Serve's autoscaler (kvfleet.worker.replica.load_report);
        call on the replica's event loop."""
        stats = self._loop.stats if self._loop else self.engine.stats()
        return replica_report(stats, self.cfg.scheduler, self.latency,
                              self.hits.rate(), revision)

    def _adapter_admin(self) -> Optional[AdapterAdmin]:
        res = self.engine.adapters
        return None if res is None else AdapterAdmin(res, self.engine.executor.config,
                                                     self.cfg.max_lora_rank, self.cfg.adapter_roots)

    def adapter_fields(self) -> dict:
        """The registry's adapter fields: servable (name, revision) and resident names."""
        res = self.engine.adapters
        if res is None:
            return {}
        return {"adapters": tuple(sorted(res.servable().items())),
                "resident_adapters": tuple(sorted(res.resident()))}

    def healthy(self) -> Optional[str]:
        """None while the replica can serve; else why not (a failed rank, a dead engine
        thread, a completed drain). Ray Serve's ``check_health`` raises with it."""
        if self.failure is not None:
            return self.failure
        try:
            self.engine.executor.ping()
        except Unavailable as exc:  # a rank failed (also reported through on_rank_failure)
            return str(exc)
        if self._loop is not None and not self._loop.alive:
            return f"replica {self.cfg.replica_id}: the engine thread died"
        if self.drained:
            return f"replica {self.cfg.replica_id} was drained"
        return None

    async def drain(self, timeout_s: Optional[float] = None) -> int:
        """Stop admitting (the registry says ``draining``: routers stop sending, and a request
        that still arrives is refused UNAVAILABLE, which routers retry elsewhere), wait up to
        ``timeout_s`` seconds (default ``cfg.drain_timeout_s``) for the streams in flight,
        end what is left with UNAVAILABLE naming the drain, then deregister (its index
        entries go too). Returns the number of sequences the timeout ended. Idempotent."""
        timeout_s = self.cfg.drain_timeout_s if timeout_s is None else timeout_s
        if self.service is None or self.drained:
            return 0
        if not self.service.draining:
            self.service.draining = True
            log.info("replica %s draining (%d sequences in flight, timeout %g s)",
                     self.cfg.replica_id, self.service.reservations.count, timeout_s)
            if self.publisher is not None:
                self.publisher.describe(state="draining")
                await self.publisher.heartbeat(self.load())
        held = self.service.reservations
        deadline = time.monotonic() + timeout_s
        while held.count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = held.count
        if left and self._loop is not None:
            log.warning("replica %s: drain timeout of %g s passed, ending %d sequences",
                        self.cfg.replica_id, timeout_s, left)
            self._loop.fail(Unavailable(
                f"replica {self.cfg.replica_id} was drained: the stream was still running "
                f"after the drain timeout of {timeout_s:g} s; retry it"))
            end = time.monotonic() + 5.0  # the ends reach their streams at the next step
            while held.count and time.monotonic() < end:
                await asyncio.sleep(0.02)
        if self._loop is not None and self.cfg.kv_host_memory_bytes and self.cfg.kv_hand_over:
            # Hand the hottest cached blocks to the node's tier within what is left of the
            # drain's time (at least a second): the node's other replicas restore them.
            n = await self._loop.hand_over(self.engine.kv.num_total_blocks,
                                           max(1.0, deadline - time.monotonic()))
            self.handed_over_blocks = n
            log.info("replica %s handed %d blocks over to the node's kv tier",
                     self.cfg.replica_id, n)
        self._stopping = True  # no beat may re-register the drained replica
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()
        if self.publisher is not None:
            await self.publisher.deregister()
        self.drained = True
        log.info("replica %s drained", self.cfg.replica_id)
        return left

    async def _heartbeat(self) -> None:
        assert self.publisher is not None  # started after the publisher
        while not self._stopping:
            try:
                # Adapter slots change too: re-published every beat ({} without adapters).
                self.publisher.describe(prefix_hit_rate=round(self.hits.rate(), 4),
                                        **self.adapter_fields())
                # The tier metrics' bytes (a Ray call when there is a tier; nothing without).
                await asyncio.to_thread(self.engine.scheduler.tier.refresh_node_stats)
                await self.publisher.heartbeat(self.load())
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Deregister, stop the gRPC server and the engine thread, then free the weights and
        the KV cache (idempotent). A stopped server may stay referenced (and is in reference
        cycles: its callbacks hold it) without holding the model."""
        self._stopping = True
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if tasks:  # their frames go now; bounded: a cancel can be lost inside a Redis call
            await asyncio.wait(tasks, timeout=STOP_TASKS_TIMEOUT_S)
        if self.publisher is not None:
            try:
                await self.publisher.deregister()
            finally:
                await self.publisher.close()
                self.publisher = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._adapter_record is not None:
            await self._adapter_record.close()
            self._adapter_record = None
        stepping = False
        if self._loop is not None:
            self._loop.stop()
            stepping = self._loop.alive  # a step past the join's bound: keep its tensors
            self._loop = None
        if self.service is not None and self.service.puller is not None:
            await self.service.puller.client.close()
        if self.engine.adapters is not None:
            self.engine.adapters.close()
        if stepping:
            log.warning("replica %s: the engine thread did not stop; its model stays loaded",
                        self.cfg.replica_id)
        else:  # releases ranks 1..T-1, then every weight and KV tensor held here
            self.engine.executor.close()
            trim_heap()
        if self.telemetry is not None and self._owns_telemetry:
            self.telemetry.shutdown()  # flushes the last spans
            self.telemetry = None
