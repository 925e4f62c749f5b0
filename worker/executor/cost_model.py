"""A cost-model executor: replaces only the model forward.

Everything else in a replica stays real: scheduler, block pool, prefix cache, KV events,
admission, sampling, detokenizing, the gRPC server. One step of a plan takes what a step-cost
model predicts for it (:class:`~kvfleet.worker.step_cost.model.CostModel`: the form the real
engine calibrates and corrects online, so simulator and engine agree)::

    step_s = step_base_s + prefill_token_s × (new tokens of chunks longer than one token)
                         + decode_token_s × (one-token chunks)
                         + context_token_s × (KV positions the chunks attend)

and :meth:`CostModelExecutor.execute` sleeps until that much time has passed since it was
called (so the engine's own scheduling and sampling time counts inside the step when it is
shorter, and on top when it is longer, as in a real replica). Tokens computed from a cached
prefix cost nothing: the block pool, not the cost model, decides what is cached, so
``cached_prompt_tokens`` is the real engine's for the same request sequence.

The constants come from :func:`~kvfleet.worker.step_cost.calibration.fit` over steps of a
real :class:`ModelRunner` (``python -m bench calibrate``, recorded with the benchmark), never
tuned to a target. Sleeping releases the GIL, so many cost-model replicas can share one process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.executor.base import RankInfo
from kvfleet.worker.kv_tier.rank_tier import NO_RANK_TIER
from kvfleet.worker.runner.lora.adapter import AdapterSpec
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.step_cost.model import MEASURED, ZERO, CostModel, with_draft_prior

FILLER_LOGIT = 30.0  # the filler token's logit; every other token's is 0
__all__ = ["MEASURED", "ZERO", "CostModel", "CostModelExecutor", "cost_model_executor",
           "filler_token_id"]


@dataclass(frozen=True)
class PausedSleep:
    """A modelled step paused before layer ``next_layer`` (``layer_s`` seconds a layer,
    ``rows`` logits rows; ``slice_start``: the clock its first slice started at)."""

    rows: int
    layer_s: float
    next_layer: int
    slice_start: float


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
        # the engine's own step-cost prior gives drafts this price too: sleep what it predicts
        self.cost = with_draft_prior(cost)
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

    pausable = True  # layer-level yield: the modelled step in config.num_layers equal slices
    tier = NO_RANK_TIER  # no KV to write back or restore

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Wait the modelled step time; returns float32 ``(plan.num_logit_rows, vocab_size)``.

        Raises:
            ValueError: see :meth:`validate`.
        """
        result = self.execute_pausable(plan, None)
        assert isinstance(result, torch.Tensor)  # no should_yield: never paused
        return result

    def execute_pausable(self, plan: StepPlan, should_yield: Callable[[], bool] | None
                         ) -> torch.Tensor | PausedSleep:
        """:meth:`execute` as ``config.num_layers`` equal slices of the modelled time, with
        ``should_yield()`` after each but the last: True returns a :class:`PausedSleep`
        (see :class:`~kvfleet.worker.executor.base.PausableExecutor`)."""
        start = self._clock()
        self.validate(plan)
        seconds = self.cost.step_seconds(plan)
        self.busy_s += seconds
        self.last_step_s = seconds
        self.steps += 1
        if should_yield is None:  # one sleep, as before layer yield
            self._sleep_until(start + seconds)
            return self._row.expand(plan.num_logit_rows, -1).clone()
        return self.resume(PausedSleep(plan.num_logit_rows, seconds / self.config.num_layers, 0,
                                       start), should_yield)

    def resume(self, paused: PausedSleep, should_yield: Callable[[], bool] | None = None
               ) -> torch.Tensor | PausedSleep:
        """Sleep the paused step's remaining slices (pausing again when ``should_yield()``).
        The pause itself adds no time: the runner resumes on the same tensors; a nested step
        in between is an ordinary :meth:`execute`, priced as a whole step."""
        layers = self.config.num_layers
        start = paused.slice_start if paused.next_layer == 0 else self._clock()
        for i in range(paused.next_layer, layers):
            start += paused.layer_s
            self._sleep_until(start)
            if should_yield is not None and i < layers - 1 and should_yield():
                return PausedSleep(paused.rows, paused.layer_s, i + 1, 0.0)
        return self._row.expand(paused.rows, -1).clone()

    def _sleep_until(self, t: float) -> None:
        remaining = t - self._clock()
        if remaining > 0:
            self._sleep(remaining)

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
