"""The step-cost model: seconds one engine step's forward takes, from the step's shape.

One linear form, used by the real engine (:class:`StepCost`, calibrated at start-up and
corrected online), by the cost-model executor (which sleeps this long) and so by the fleet
simulator, so that all three agree::

    step_s = step_base_s + decode_token_s · decode_rows + prefill_token_s · prefill_tokens
                         + context_token_s · context_tokens + draft_token_s · draft_tokens
                         + gemm_step_s · [decode_rows + prefill_tokens + draft_tokens > few_rows]

* ``decode_rows``: chunks of one new token (a decode, or the last token of a prompt);
* ``prefill_tokens``: new tokens of the chunks longer than one token;
* ``draft_tokens``: speculative drafts verified on decode rows (``SeqChunk.num_draft_tokens``).
  A verify chunk is its decode row plus its drafts, not a prefill chunk: beside a decode step
  a draft costs what an extra query row costs while the step still streams each weight once
  (on CPU, the few-row kernel of :mod:`kvfleet.worker.runner.cpu_kernels`), which is neither a
  decode row (its own attention read and sampling) nor a compute-bound prefill token;
* ``context_tokens``: KV positions the step's attention reads, summed over its chunks: a
  chunk of ``n`` new tokens after ``c`` computed ones reads :func:`attended` ``(c, n) = c + n``
  positions of K and V. For decode rows that is the KV bytes a step streams, which dominates
  a long-context decode batch; a prefill chunk's query × key compute is counted once per
  position, not per pair (on CPU a chunk after a long prefix costs little more than after
  none, where a pair count charged at the decode rate would predict many times more);
* ``gemm_step_s``: a fixed cost of a step whose query rows (decode rows + prefill tokens +
  drafts) exceed ``few_rows``. On CPU every projection takes up to ``few_rows`` rows through
  the few-row kernel (:data:`kvfleet.worker.runner.models.linear.FEW_ROWS`) and more through
  oneDNN's GEMM, which costs about the same a row but more a call: a whole prompt's step pays
  it, a small chunk beside the decode rows (what an ITL target schedules) does not. The term
  is on the decode side of the online correction (it is a step's fixed cost, like the base).
  ``few_rows`` 0 (the default; GPUs, older calibrations): one path, no such term.

Tokens served from the prefix cache cost nothing: they are never in a chunk; they only add to
``c`` of the chunk after them. Everything here is torch-free arithmetic.

A layer-yield nested step (:mod:`kvfleet.worker.engine.layer_yield`) is priced as a whole step,
step base included: its forward shares no work with the paused one (it embeds its own tokens,
reads every layer's weights again, runs its own LM head), and pausing and resuming redo nothing
(the paused forward goes on with the same tensors). ``bench nested_cost`` measures both on the
real runner. Only merging the nested rows into the paused step's remaining layers would share
the base, and then their first tokens wait for the paused step's end (docs/slo.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple, Protocol

from kvfleet.measured_costs import MEASURED_STEP_COSTS
from kvfleet.worker.engine.step_plan import StepPlan


def attended(num_computed_tokens: int, num_new_tokens: int) -> int:
    """KV positions one chunk's attention reads: its prefix and its own new tokens (the
    ``context_tokens`` one chunk adds; a request's uncached prompt of ``P`` tokens after ``c``
    cached ones, run as one chunk, adds ``c + P``)."""
    return num_computed_tokens + num_new_tokens


def past_few_rows(few_rows: int, query_rows: int) -> float:
    """1.0 when a step of ``query_rows`` rows leaves the few-row kernel (more than
    ``few_rows``, which is > 0), else 0.0: the ``gemm_step_s`` term's factor."""
    return 1.0 if 0 < few_rows < query_rows else 0.0


class StepShape(NamedTuple):
    """What the cost of one step depends on (see the module docstring)."""

    decode_rows: int
    prefill_tokens: int
    context_tokens: int
    draft_tokens: int = 0


def plan_shape(plan: StepPlan) -> StepShape:
    """The :class:`StepShape` of ``plan``: a one-token chunk counts as a decode row, a chunk
    with drafts as a decode row and its drafts."""
    decode = prefill = context = drafts = 0
    for c in plan.chunks:
        n = len(c.token_ids)
        if n == 1 or c.num_draft_tokens:
            decode += 1
            drafts += n - 1
        else:
            prefill += n
        context += attended(c.num_computed_tokens, n)
    return StepShape(decode, prefill, context, drafts)


# Weight of each new step in the mean time outside the forward: a measurement, not a correction
# of the prior, so it moves even where the forward's correction is off (alpha 0).
OUTSIDE_WEIGHT = 0.05


class StepCostModel(Protocol):
    """What the scheduler's time budget and the router's queue-delay estimate code against."""

    def predict_step_s(self, decode_rows: int, prefill_tokens: int, context_tokens: int,
                       draft_tokens: int = 0) -> float:
        """Predicted seconds of one step of this shape (0 for an empty step)."""
        ...


@dataclass(frozen=True)
class CostModel:
    """The constants of the linear form (seconds per step, per row, per token, per attended
    position). ``source`` says where they were measured (model, machine, threads, date).

    Raises:
        ValueError: a negative constant.
    """

    step_base_s: float
    prefill_token_s: float
    decode_token_s: float
    source: str = ""
    context_token_s: float = 0.0  # last four: older calibration files and callers omit them
    draft_token_s: float = 0.0
    gemm_step_s: float = 0.0
    few_rows: int = 0  # query rows a step may have within the few-row kernel (0: no such path)

    def __post_init__(self) -> None:
        if min(self.step_base_s, self.prefill_token_s, self.decode_token_s,
               self.context_token_s, self.draft_token_s, self.gemm_step_s, self.few_rows) < 0:
            raise ValueError(f"cost model constants must be >= 0, got {self}")

    def predict_step_s(self, decode_rows: int, prefill_tokens: int, context_tokens: int,
                       draft_tokens: int = 0) -> float:
        """Modelled seconds of one step of this shape (0 when it computes nothing)."""
        if decode_rows == 0 and prefill_tokens == 0:
            return 0.0
        return (self.step_base_s + self.decode_token_s * decode_rows
                + self.prefill_token_s * prefill_tokens + self.context_token_s * context_tokens
                + self.draft_token_s * draft_tokens
                + self.gemm_step_s * past_few_rows(self.few_rows,
                                                   decode_rows + prefill_tokens + draft_tokens))

    def step_seconds(self, plan: StepPlan) -> float:
        """Modelled duration of one forward over ``plan`` (0 for an empty plan)."""
        return self.predict_step_s(*plan_shape(plan))

    def scaled(self, factor: float) -> "CostModel":
        """Every constant × ``factor`` (a faster or slower replica; ratios unchanged).

        Raises:
            ValueError: ``factor`` <= 0.
        """
        if not factor > 0:
            raise ValueError(f"time scale must be > 0, got {factor}")
        return CostModel(self.step_base_s * factor, self.prefill_token_s * factor,
                         self.decode_token_s * factor, f"{self.source} × {factor:g}",
                         self.context_token_s * factor, self.draft_token_s * factor,
                         self.gemm_step_s * factor, self.few_rows)

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "CostModel":
        """From :meth:`to_json`'s object (``context_token_s``, ``draft_token_s``,
        ``gemm_step_s``, ``few_rows`` may be absent: 0; a model without a draft term prices a
        draft as a prefill token, see :func:`with_draft_prior`).

        Raises:
            KeyError, ValueError: a missing or bad constant.
        """
        return cls(float(data["step_base_s"]), float(data["prefill_token_s"]),
                   float(data["decode_token_s"]), str(data.get("source", source)),
                   float(data.get("context_token_s", 0.0)), float(data.get("draft_token_s", 0.0)),
                   float(data.get("gemm_step_s", 0.0)), int(data.get("few_rows", 0)))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read the ``cost_model`` object of a calibration JSON file (or a bare one)."""
        data = json.loads(Path(path).read_text())
        return cls.from_json(data.get("cost_model", data), str(path))

    def to_json(self) -> dict:
        return asdict(self)


# Measured with ``python -m bench.calibrate`` on SmolLM2-135M-Instruct, fp32, one torch
# thread, on the 2-core development machine (bench/results/calibration.json holds the samples).
MEASURED = CostModel(*MEASURED_STEP_COSTS)


def with_draft_prior(cost: CostModel) -> CostModel:
    """``cost``, or where it has no draft term (an older calibration, :data:`MEASURED`) the
    same with ``draft_token_s = prefill_token_s``: a draft priced as a prefill token until a
    calibration or the online correction (:class:`StepCost`'s draft side) says otherwise."""
    if cost.draft_token_s > 0 or cost.prefill_token_s <= 0:
        return cost
    return replace(cost, draft_token_s=cost.prefill_token_s)


ZERO = CostModel(0.0, 0.0, 0.0, "zero: answers at once")

MAX_LOG_RATIO = math.log(4.0)  # one step counts as at most ×4 off (a GC pause, a swap)
MAX_LOG_SCALE = math.log(16.0)  # a side corrected past ×16 either way needs recalibrating
SIDES = ("decode", "prefill", "draft")
FIT_DECAY = 0.99  # weight of the past in the draft-slope fit, per step without prefill
# 1 - (uncentred correlation of the decode and draft sides)² below which the fit cannot tell
# a draft's price from the step's (steps that all carry the same drafts): share-out instead
FIT_MIN_SPREAD = 0.02
FIT_MIN_STEPS = 8.0  # decayed steps with drafts before the fit prices drafts


class StepCost:
    """A replica's step-cost model: a calibrated :class:`CostModel` × an online correction
    per side of the step.

    The prediction splits in three: the **decode side** (base + decode rows + KV positions
    attended), the **prefill side** (prefill tokens) and the **draft side** (speculative
    drafts verified), each × its own scale; a prior without a draft term gets
    :func:`with_draft_prior`'s. After each
    forward the engine calls :meth:`observe` with the step's shape and measured seconds; the
    error ``e = log(measured / predicted)``, clipped to ``±log 4``, is shared out by each
    side's share of the prediction: ``log scale_side += alpha × share_side × e / Σ share²``
    (a normalized gradient step on the squared log error: the step's own prediction moves by
    ``alpha × e``, as one scale's would). A decode-only step corrects the decode side alone,
    so a prefill priced 2× wrong is learnt from steps with prefill while decode steps keep
    the decode side where it is; likewise drafts from steps that verify some. Bounded: one
    step moves a scale by at most ``4^(1.37 alpha)``, and a scale stays within ``16^±1`` of
    the calibration. ``alpha`` 0 keeps the prior fixed (tests, a modelled executor).

    The draft side is not left to that share-out once it can be measured directly: a draft's
    price is the **slope** of a step's seconds in its drafts. Every step without prefill adds
    to a decayed least-squares fit ``measured ≈ a · decode_side + b · draft_side`` (the prior's
    seconds of each side; a step more than ``4^±1`` off its prediction, where the error is
    clipped, does not enter it); once the fit holds :data:`FIT_MIN_STEPS` verify steps whose
    draft counts vary enough beside their decode side for the two to separate
    (:data:`FIT_MIN_SPREAD`), the draft side is priced at ``b ÷ a`` of the decode
    side's scale and the share-out moves the other sides alone. Whatever slows every step alike
    (a loaded host, a prior that is far off, a decode side held at its bound) moves ``a`` and
    ``b`` together and the decode side with them, so a draft's price beside the step's — what
    sizing weighs against its expected gain — stays the marginal cost of one more query row.

    ``predicted_total_s`` / ``measured_total_s`` / ``steps`` (and the last pair) are what the
    metrics export, with :attr:`decode_scale` and :attr:`prefill_scale`: their rates' ratio
    is the drift an operator watches. Written on the engine thread; read from any (floats:
    no lock needed).

    Raises:
        ValueError: ``alpha`` outside [0, 1].
    """

    def __init__(self, prior: CostModel, alpha: float = 0.05) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.prior = with_draft_prior(prior)
        self.alpha = alpha
        self.log_scales = [0.0] * len(SIDES)
        self.steps = 0
        self.predicted_total_s = 0.0
        self.measured_total_s = 0.0
        self.last_predicted_s = 0.0
        self.last_measured_s = 0.0
        self.outside_s = 0.0  # seconds a busy step spends outside its forward (decayed mean)
        # decayed sums of the draft-slope fit: decode side u, draft side v, measured y
        self._fit = dict.fromkeys(("uu", "uv", "vv", "verify", "uy", "vy"), 0.0)

    @property
    def decode_scale(self) -> float:
        """measured ÷ prior of the decode side (base, decode rows, context), as estimated."""
        return math.exp(self.log_scales[0])

    @property
    def prefill_scale(self) -> float:
        """measured ÷ prior of the prefill side (prefill tokens), as estimated."""
        return math.exp(self.log_scales[1])

    @property
    def draft_scale(self) -> float:
        """measured ÷ prior of the draft side (drafts verified), as estimated."""
        return math.exp(self.log_scales[2])

    def _sides(self, decode_rows: int, prefill_tokens: int, context_tokens: int,
               draft_tokens: int = 0) -> tuple[float, ...]:
        """The prior's seconds of each of :data:`SIDES` (all 0: empty)."""
        total = self.prior.predict_step_s(decode_rows, prefill_tokens, context_tokens, draft_tokens)
        if total <= 0:
            return (0.0,) * len(SIDES)
        prefill = self.prior.prefill_token_s * prefill_tokens
        drafts = self.prior.draft_token_s * draft_tokens
        return total - prefill - drafts, prefill, drafts

    def _scaled(self, sides: tuple[float, ...]) -> list[float]:
        return [part * math.exp(log) for part, log in zip(sides, self.log_scales, strict=True)]

    def predict_step_s(self, decode_rows: int, prefill_tokens: int, context_tokens: int,
                       draft_tokens: int = 0) -> float:
        """Predicted seconds of one step's forward of this shape (0 when it computes nothing)."""
        return sum(self._scaled(self._sides(decode_rows, prefill_tokens, context_tokens,
                                            draft_tokens)))

    def corrected(self) -> CostModel:
        """The prior with each side's scale applied (the decode side's to the base, decode
        rows, context and GEMM terms): the constants this model now predicts with."""
        d, p, dr = (math.exp(x) for x in self.log_scales)
        c = self.prior
        return replace(c, step_base_s=c.step_base_s * d, decode_token_s=c.decode_token_s * d,
                       context_token_s=c.context_token_s * d, gemm_step_s=c.gemm_step_s * d,
                       prefill_token_s=c.prefill_token_s * p, draft_token_s=c.draft_token_s * dr)

    def predict_plan_s(self, plan: StepPlan) -> float:
        """Predicted seconds of the forward over ``plan``."""
        return self.predict_step_s(*plan_shape(plan))

    def observe(self, shape: StepShape, measured_s: float) -> None:
        """Record one forward of ``shape`` that took ``measured_s`` seconds."""
        sides = self._scaled(self._sides(*shape))
        predicted = sum(sides)
        if predicted <= 0 or not measured_s > 0:
            return  # nothing computed, or a clock that did not move: no information
        self.last_predicted_s = predicted  # what the scheduler planned with
        self.last_measured_s = measured_s
        self.predicted_total_s += predicted
        self.measured_total_s += measured_s
        self.steps += 1
        raw_error = math.log(measured_s / predicted)
        error = max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, raw_error))
        relative = self._fit_draft_slope(shape, measured_s, outlier=error != raw_error)
        shares = [part / predicted for part in sides]
        if relative is not None:  # the draft side is the fit's: the share-out explains the rest
            shares[2] = 0.0
        norm = sum(x * x for x in shares)  # in [1/3, 1]: the prediction moves by alpha × error
        for i, share in enumerate(shares):
            moved = self.log_scales[i] + self.alpha * share / norm * error
            self.log_scales[i] = max(-MAX_LOG_SCALE, min(MAX_LOG_SCALE, moved))
        if relative is not None:  # beside the decode side as it now stands
            moved = self.log_scales[0] + relative
            self.log_scales[2] = max(-MAX_LOG_SCALE, min(MAX_LOG_SCALE, moved))

    def observe_outside(self, seconds: float) -> None:
        """Record the seconds between one forward's end and the next one's start while
        requests kept running (scheduling, sampling, emitting): what every step costs beyond
        its forward, so a plan of more steps pays it more times. Negative values are ignored."""
        if seconds >= 0:
            self.outside_s += OUTSIDE_WEIGHT * (seconds - self.outside_s)

    def _fit_draft_slope(self, shape: StepShape, measured_s: float, outlier: bool) -> float | None:
        """Add one step to the draft-slope fit (steps without prefill, not ``outlier``: more
        than ×4 off the prediction, a pause or a prior not yet corrected; see the class
        docstring); the log of the draft side's scale over the decode side's where the fit
        separates them, else None."""
        if self.alpha <= 0 or self.prior.draft_token_s <= 0:
            return None
        u, prefill, v = self._sides(*shape)
        if prefill > 0 or u <= 0:
            return None
        f = self._fit
        if not outlier:
            for key, value in (("uu", u * u), ("uv", u * v), ("vv", v * v),
                               ("verify", float(v > 0)), ("uy", u * measured_s),
                               ("vy", v * measured_s)):
                f[key] = FIT_DECAY * f[key] + value
        det = f["uu"] * f["vv"] - f["uv"] ** 2
        if f["verify"] < FIT_MIN_STEPS or det <= FIT_MIN_SPREAD * f["uu"] * f["vv"]:
            return None
        per_step = (f["vv"] * f["uy"] - f["uv"] * f["vy"]) / det
        per_draft = (f["uu"] * f["vy"] - f["uv"] * f["uy"]) / det
        if per_step <= 0:
            return None
        # relative to the decode side: what slows every step alike moves both together
        return math.log(max(per_draft / per_step, math.exp(-2 * MAX_LOG_SCALE)))
