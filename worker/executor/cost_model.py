"""A cost-model executor: replaces only the model forward.

Everything else in a replica stays real: scheduler, block pool, prefix cache, KV events,
admission, sampling, detokenizing, the gRPC server. One step of a plan takes

    step_s = step_base_s + prefill_token_s × (new tokens of chunks longer than one token)
                         + decode_token_s × (one-token chunks)

and :meth:`CostModelExecutor.execute` sleeps until that much time has passed since it was
called (so the engine's own scheduling and sampling time counts inside the step when it is
shorter, and on top when it is longer, as in a real replica). Tokens computed from a cached
prefix cost nothing: the block pool, not the cost model, decides what is cached, so
``cached_prompt_tokens`` is the real engine's for the same request sequence.

The constants come from :func:`calibrate` run against a real :class:`ModelRunner`
(``python -m bench.calibrate``, recorded with the benchmark), never tuned to a target.
Sleeping releases the GIL, so many cost-model replicas can share one process.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from kvfleet.allocator.units import cdiv
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.executor.base import RankInfo
from kvfleet.worker.runner.lora.adapter import AdapterSpec
from kvfleet.worker.runner.model_config import ModelConfig

FILLER_LOGIT = 30.0  # the filler token's logit; every other token's is 0


@dataclass(frozen=True)
class CostModel:
    """Seconds per step: ``step_base_s + prefill_token_s·prefill + decode_token_s·decode``.

    ``source`` says where the constants were measured (model, machine, threads, date).
    """

    step_base_s: float
    prefill_token_s: float
    decode_token_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.step_base_s, self.prefill_token_s, self.decode_token_s) < 0:
            raise ValueError(f"cost model constants must be >= 0, got {self}")

    def step_seconds(self, plan: StepPlan) -> float:
        """Modelled duration of one forward over ``plan`` (0 for an empty plan)."""
        if not plan.chunks:
            return 0.0
        prefill, decode = split_tokens(plan)
        return self.step_base_s + self.prefill_token_s * prefill + self.decode_token_s * decode

    def scaled(self, factor: float) -> "CostModel":
        """Every constant × ``factor`` (a faster or slower replica; ratios unchanged)."""
        if factor <= 0:
            raise ValueError(f"time scale must be > 0, got {factor}")
        return CostModel(self.step_base_s * factor, self.prefill_token_s * factor,
                         self.decode_token_s * factor, f"{self.source} × {factor:g}")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read the ``cost_model`` object of a calibration JSON file (or a bare one)."""
        data = json.loads(Path(path).read_text())
        data = data.get("cost_model", data)
        return cls(float(data["step_base_s"]), float(data["prefill_token_s"]),
                   float(data["decode_token_s"]), str(data.get("source", path)))

    def to_json(self) -> dict:
        return asdict(self)


# Measured with ``python -m bench.calibrate`` on SmolLM2-135M-Instruct, fp32, one torch
# thread, on the 2-core development machine (bench/results/calibration.json holds the samples).
MEASURED = CostModel(0.319826, 0.0125125, 0.0881751,
                     'SmolLM2-135M-Instruct fp32, 1 torch thread(s), vm (2 CPUs), 2026-11-30')
ZERO = CostModel(0.0, 0.0, 0.0, "zero: answers at once")


def split_tokens(plan: StepPlan) -> tuple[int, int]:
    """(prefill tokens, decode tokens): a one-token chunk counts as a decode."""
    prefill = sum(len(c.token_ids) for c in plan.chunks if len(c.token_ids) > 1)
    decode = sum(1 for c in plan.chunks if len(c.token_ids) == 1)
    return prefill, decode


class CostModelExecutor:
    """:class:`~kvfleet.worker.executor.base.Executor` with no model: each step takes the
    modelled time. It holds no weights, KV tensors or adapter slots.

    Returns logits that make every sample pick ``filler_token_id`` (greedy or not), so a
    request runs to ``max_tokens`` unless the filler is a stop token. ``sleep`` and ``clock``
    are injectable for tests.
    """

    def __init__(self, config: ModelConfig, cost: CostModel, filler_token_id: int,
                 num_blocks: int, block_size: int,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0 <= filler_token_id < config.vocab_size:
            raise ValueError(f"filler_token_id must lie in [0, {config.vocab_size})")
        self.config = config
        self.cost = cost
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._sleep, self._clock = sleep, clock
        self._row = torch.zeros(config.vocab_size, dtype=torch.float32)
        self._row[filler_token_id] = FILLER_LOGIT
        self.busy_s = 0.0  # modelled forward time so far (seconds)
        self.last_step_s = 0.0
        self.steps = 0

    def validate(self, plan: StepPlan) -> None:
        """Raises ValueError when a chunk's block table does not cover it (a scheduler bug)."""
        for c in plan.chunks:
            last = c.num_computed_tokens + len(c.token_ids) - 1
            if len(c.block_table) * self.block_size <= last:
                raise ValueError(f"sequence {c.seq_id}: block_table of {len(c.block_table)} "
                                 f"blocks does not cover position {last}")

    def transfer_blocks(self, saves, restores) -> bool:
        """No KV to move: succeeds only when nothing is to be restored."""
        return not restores

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Wait the modelled step time; returns float32 ``(len(plan.chunks), vocab_size)``.

        Raises:
            ValueError: see :meth:`validate`.
        """
        start = self._clock()
        self.validate(plan)
        seconds = self.cost.step_seconds(plan)
        self.busy_s += seconds
        self.last_step_s = seconds
        self.steps += 1
        remaining = seconds - (self._clock() - start)
        if remaining > 0:
            self._sleep(remaining)
        return self._row.expand(len(plan.chunks), -1).clone()

    def load_adapter(self, slot: int, spec: AdapterSpec) -> None:
        """Raises ValueError: the cost model serves no adapters."""
        raise ValueError("the cost-model executor has no adapter slots")

    def unload_adapter(self, slot: int) -> None:
        """Raises ValueError: the cost model serves no adapters."""
        raise ValueError("the cost-model executor has no adapter slots")

    def ping(self) -> None:
        """Always healthy: nothing can die."""

    def ranks(self) -> list[RankInfo]:
        """None: it holds no weights or KV tensors."""
        return []

    def close(self) -> None:
        """Nothing to release."""


def filler_token_id(tokenizer, eos_token_ids: Iterable[int]) -> int:
    """A plain-word token (`` the``) to emit, never an end-of-sequence token."""
    eos = set(eos_token_ids)
    ids = [i for i in tokenizer.encode(" the", add_special_tokens=False).ids if i not in eos]
    if ids:
        return ids[0]
    return next(i for i in range(tokenizer.get_vocab_size()) if i not in eos)


def cost_model_executor(config: ModelConfig, tokenizer, num_blocks: int, block_size: int,
                        cost: CostModel | None = None) -> CostModelExecutor:
    """The executor ``build_engine`` plugs in for ``executor="cost-model"`` (default:
    ``MEASURED``)."""
    return CostModelExecutor(config, cost or MEASURED, filler_token_id(tokenizer, config.eos_token_ids),
                           num_blocks, block_size)


# ---- calibration against a real runner ------------------------------------------------------

@dataclass(frozen=True)
class StepSample:
    """One measured forward: its prefill and decode token counts and median seconds."""

    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    seconds: float


def fit(samples: Sequence[StepSample], source: str = "") -> CostModel:
    """Least-squares ``seconds ≈ a + b·prefill + c·decode`` (negative constants clipped to 0)."""
    x = torch.tensor([[1.0, s.prefill_tokens, s.decode_tokens] for s in samples],
                     dtype=torch.float64)
    y = torch.tensor([[s.seconds] for s in samples], dtype=torch.float64)
    a, b, c = (max(0.0, float(v)) for v in torch.linalg.lstsq(x, y).solution.flatten())
    return CostModel(a, b, c, source)


def calibration_plans(block_size: int, prefill_sizes: Iterable[int], contexts: Iterable[int],
                      decode_batches: Iterable[int], decode_context: int):
    """(prefill, decode, context, plan) shapes to measure; block tables are disjoint ranges."""
    from kvfleet.worker.engine.step_plan import SeqChunk

    def chunk(rid: str, n: int, ctx: int, first_block: int) -> SeqChunk:
        blocks = cdiv(ctx + n, block_size)
        return SeqChunk(rid, tuple(100 + (i % 1000) for i in range(n)), ctx,
                        tuple(range(first_block, first_block + blocks)))

    for ctx in contexts:
        for n in prefill_sizes:
            yield n, 0, ctx, StepPlan((chunk("p", n, ctx, 0),))
    for batch in decode_batches:
        per = cdiv(decode_context + 1, block_size)
        plan = StepPlan(tuple(chunk(f"d{i}", 1, decode_context, i * per) for i in range(batch)))
        yield 0, batch, decode_context, plan


def measure(runner, plans, repeats: int = 3) -> list[StepSample]:
    """Median wall time of ``runner.execute`` per plan (one warm-up call first)."""
    out = []
    for prefill, decode, ctx, plan in plans:
        runner.execute(plan)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - t0)
        out.append(StepSample(prefill, decode, ctx, sorted(times)[len(times) // 2]))
    return out
