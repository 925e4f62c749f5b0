"""Per-step records of an engine run: each forward's shape, predicted and measured seconds,
and the whole ``engine.step()`` around it (scheduling, sampling, detokenizing): where an ITL
tail comes from. Used by ``python -m bench itl --trace``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.common.stream_stats import pct
from kvfleet.worker.step_cost.model import CostModel, StepCost, StepShape


@dataclass(frozen=True)
class StepRecord:
    """One forward: its shape, the prediction the scheduler planned with (s), the forward's
    measured seconds, and the engine step's wall seconds (0 until joined)."""

    decode_rows: int
    prefill_tokens: int
    context_tokens: int
    predicted_s: float
    forward_s: float
    step_s: float = 0.0


class TracingStepCost(StepCost):
    """A :class:`StepCost` that keeps a :class:`StepRecord` per observed forward; pass
    :meth:`step_done` as ``run_engine``'s ``on_step`` to give each its step's wall time."""

    def __init__(self, prior: CostModel, alpha: float = 0.05) -> None:
        super().__init__(prior, alpha)
        self.records: list[StepRecord] = []
        self._joined = 0

    def observe(self, shape: StepShape, measured_s: float) -> None:
        self.records.append(StepRecord(*shape[:3], self.predict_step_s(*shape), measured_s))
        super().observe(shape, measured_s)

    def step_done(self, wall_s: float) -> None:
        """One ``engine.step()`` took ``wall_s``: the forward it ran, if any, gets it."""
        if self._joined < len(self.records):
            self.records[-1] = replace(self.records[-1], step_s=wall_s)
            self._joined = len(self.records)


PREFILL_CLASSES = ((0, 32), (32, 128), (128, 512))  # (lo, hi]: prefill tokens of a step


def summarize(records: list[StepRecord], target_s: float | None) -> dict:
    """Where step time goes: measured ÷ predicted forward (p50/p90/p99, decode-only steps and
    steps with prefill apart, and the latter by :data:`PREFILL_CLASSES`), the step's time
    outside the forward, and how many steps ran past ``target_s`` (and past it by more than
    20 %)."""
    def ratios(rs: list[StepRecord]) -> dict:
        xs = [r.forward_s / r.predicted_s for r in rs if r.predicted_s > 0]
        return {"steps": len(rs), **{f"p{q}": pct(xs, q / 100) for q in (50, 90, 99)}}

    out = {
        "decode_only": ratios([r for r in records if r.prefill_tokens == 0]),
        "with_prefill": ratios([r for r in records if r.prefill_tokens > 0]),
        "by_prefill_tokens": {f"{lo + 1}-{hi}": ratios([r for r in records if lo < r.prefill_tokens <= hi])
                              for lo, hi in PREFILL_CLASSES},
        "outside_forward_s": {f"p{q}": pct([r.step_s - r.forward_s for r in records], q / 100)
                              for q in (50, 90, 99)},
        "step_s": {f"p{q}": pct([r.step_s for r in records], q / 100) for q in (50, 90, 99)},
        "forward_s_total": sum(r.forward_s for r in records),
        "step_s_total": sum(r.step_s for r in records),
    }
    if target_s is not None:
        out["over_target"] = sum(r.step_s > target_s for r in records)
        out["over_target_1.2"] = sum(r.step_s > 1.2 * target_s for r in records)
    return out
