"""Fitting the step-cost model's constants from timed steps, robustly.

Timings on a shared host are noisy upward (a neighbour only ever slows a step), so:

* each shape is timed several times and its **minimum** kept (:mod:`.calibration`);
* the constants are the **non-negative least squares** fit (Lawson–Hanson) of
  ``seconds ≈ base + prefill·p + decode·d + context·c + draft·v + gemm·[p + d + v > few_rows]``
  in relative error (each row divided by its seconds, so a short decode step weighs as much as
  a long prefill): no constant can come out negative. ``few_rows`` 0: no GEMM-path column (its
  constant is 0); with it, the samples must include steps on both sides of ``few_rows`` (the
  start-up shapes do) for the term to be told apart from the base;
* a shape that ran much slower than a fit of the other shapes predicts (a shape whose every
  repeat was disturbed) is dropped and the rest refitted, one at a time, while more shapes
  than constants remain (:func:`robust_fit`);
* finally each constant is **clamped** to ``[CLAMP_LO, CLAMP_HI] ×`` a reference model's
  (the cached or ``MEASURED`` constants) scaled to the measured steps' level: the reference
  gives plausible *ratios* between terms, the timings their level. A clamp is logged: it
  means the fit was degenerate (e.g. a term fitted at 0 because noise hid it).

Torch only for the small least-squares solves.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from statistics import median
from typing import Optional, Sequence

import torch

from kvfleet.worker.step_cost.model import CostModel, past_few_rows

log = logging.getLogger(__name__)
TERMS = ("step_base_s", "prefill_token_s", "decode_token_s", "context_token_s", "draft_token_s",
         "gemm_step_s")
OUTLIER_LOG_RATIO = math.log(1.5)  # a shape fitted 1.5x off (either way) is suspect...
OUTLIER_OVER_MEDIAN = 3.0          # ... when also 3x further off than the median shape
CLAMP_LO, CLAMP_HI = 0.2, 5.0      # × the reference's constant, scaled to these timings


@dataclass(frozen=True)
class StepSample:
    """One measured forward: its shape (see :class:`~.model.StepShape`) and seconds."""

    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    seconds: float
    draft_tokens: int = 0  # last: older calibration files omit it

    def features(self, few_rows: int = 0) -> list[float]:
        """The row of the linear form: ``[1, prefill, decode, context, drafts, past]``, ``past``
        1 when the step's query rows exceed ``few_rows`` > 0 (:func:`~.model.past_few_rows`)."""
        rows = self.prefill_tokens + self.decode_tokens + self.draft_tokens
        return [1.0, float(self.prefill_tokens), float(self.decode_tokens),
                float(self.context_tokens), float(self.draft_tokens), past_few_rows(few_rows, rows)]


def nnls(a: torch.Tensor, b: torch.Tensor, max_iter: int = 50) -> torch.Tensor:
    """Lawson–Hanson non-negative least squares: ``argmin ‖a x − b‖`` over ``x ≥ 0``.

    Args:
        a: ``(m, n)`` float64; b: ``(m,)`` float64.

    Returns:
        ``(n,)`` float64, every entry >= 0 (a column that is all zeros gets 0).
    """
    n = a.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    tol = 1e-12 * float(a.abs().max().clamp(min=1.0)) * max(a.shape)
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        free = (~passive) & (grad > tol)
        if not bool(free.any()):
            break
        passive[int(torch.argmax(torch.where(free, grad, torch.full_like(grad, -math.inf))))] = True
        while True:  # solve on the passive set; step back while any of it would go negative
            idx = passive.nonzero().flatten()
            z = torch.zeros(n, dtype=torch.float64)
            z[idx] = torch.linalg.lstsq(a[:, idx], b[:, None]).solution.flatten()
            if bool((z[idx] > 0).all()):
                x = z
                break
            neg = idx[z[idx] <= 0]
            gap = x[neg] - z[neg]  # >= 0: x > 0 >= z on the passive set
            alpha = float(torch.min(torch.where(gap > 0, x[neg] / gap.clamp(min=1e-300), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not bool(passive.any()):
                break
    return x


def _fit_once(samples: Sequence[StepSample], few_rows: int = 0) -> list[float]:
    x = torch.tensor([s.features(few_rows) for s in samples], dtype=torch.float64)
    y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
    w = 1.0 / y.clamp(min=1e-9)
    return [float(v) for v in nnls(x * w[:, None], y * w)]


def _predict(coef: Sequence[float], s: StepSample, few_rows: int) -> float:
    return sum(c * f for c, f in zip(coef, s.features(few_rows), strict=True))


def _excess(coef: Sequence[float], s: StepSample, few_rows: int) -> float:
    """log(measured ÷ fitted): how much slower than the fit a shape ran."""
    return math.log(s.seconds / max(_predict(coef, s, few_rows), 1e-12))


def robust_fit(samples: Sequence[StepSample], few_rows: int = 0
               ) -> tuple[list[float], list[StepSample]]:
    """The NNLS constants (in :data:`TERMS` order) and the samples they were fitted on, after
    dropping outlier shapes one at a time: the shape that ran slowest against a fit of the
    others (a leave-one-out fit, so an outlier cannot bend the fit towards itself), when that
    is past :data:`OUTLIER_LOG_RATIO` and :data:`OUTLIER_OVER_MEDIAN` × the median shape's.
    Only slow shapes are dropped: a neighbour never makes a step faster.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("no samples to fit")
    kept = list(samples)
    fitted = len(TERMS) - (few_rows <= 0)  # without the GEMM-path column one term fewer
    while len(kept) > fitted + 1:
        excess = [_excess(_fit_once(kept[:i] + kept[i + 1:], few_rows), s, few_rows)
                  for i, s in enumerate(kept)]
        worst = max(range(len(kept)), key=excess.__getitem__)
        rest = median(abs(e) for i, e in enumerate(excess) if i != worst)
        if excess[worst] <= max(OUTLIER_LOG_RATIO, OUTLIER_OVER_MEDIAN * rest):
            break
        log.info("step-cost fit: dropped %s (%.2fx slower than the other shapes predict)",
                 kept[worst], math.exp(excess[worst]))
        kept.pop(worst)
    return _fit_once(kept, few_rows), kept


def clamp_to_reference(cost: CostModel, reference: CostModel,
                       samples: Sequence[StepSample]) -> CostModel:
    """``cost`` with each constant clamped to ``[CLAMP_LO, CLAMP_HI] ×`` ``reference``'s, after
    scaling ``reference`` to ``samples`` (the median of measured ÷ reference-predicted). A
    constant the reference has at 0 is left alone. Each clamp is logged as a warning."""
    ratios = [s.seconds / p for s in samples
              if (p := reference.predict_step_s(s.decode_tokens, s.prefill_tokens, s.context_tokens,
                                                s.draft_tokens)) > 0]
    if not ratios:
        return cost
    level = median(ratios)
    changed = {}
    for term in TERMS:
        ref = getattr(reference, term) * level
        got = getattr(cost, term)
        if ref > 0 and not CLAMP_LO * ref <= got <= CLAMP_HI * ref:
            changed[term] = min(max(got, CLAMP_LO * ref), CLAMP_HI * ref)
    if not changed:
        return cost
    log.warning("step-cost fit degenerate: clamped %s to [%g, %g] x %s scaled by %.3g (fitted %s)",
                changed, CLAMP_LO, CLAMP_HI, reference.source or "the reference", level,
                {t: getattr(cost, t) for t in changed})
    return replace(cost, **changed, source=f"{cost.source} (clamped: {', '.join(changed)})")


def fit(samples: Sequence[StepSample], source: str = "",
        reference: Optional[CostModel] = None, few_rows: int = 0) -> CostModel:
    """The step-cost model of ``samples``: :func:`robust_fit`, then, with a ``reference``,
    :func:`clamp_to_reference`. Terms no sample varies are 0 (unless clamped up).
    ``few_rows``: the few-row kernel's reach on the timed device (0: none; the model keeps it).

    Raises:
        ValueError: no samples.
    """
    coef, kept = robust_fit(samples, few_rows)
    cost = CostModel(coef[0], coef[1], coef[2], source, coef[3], coef[4], coef[5], few_rows)
    return clamp_to_reference(cost, reference, kept) if reference is not None else cost
