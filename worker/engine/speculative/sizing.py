"""How many drafts each decode row verifies this step: the count that maximises the step's
expected tokens per predicted second.

A row whose recent drafts were accepted at rate ``a`` (per drafted token) is modelled as
accepting its ``j``-th draft with probability ``a^j``, so ``d`` drafts add ``a + … + a^d``
expected tokens beside the one it samples anyway. Their price is the step-cost model's: a
decode row that carries ``d`` drafts stays a decode row and adds ``d`` draft tokens, which
attend ``d`` more positions (the model's draft term, calibrated on verify steps and corrected
online from every step that verifies drafts; see :mod:`kvfleet.worker.step_cost.model`).
Drafts are handed out greedily, best expected gain first, while each one raises the step's
expected tokens ÷ predicted seconds: at a large batch or a low acceptance rate the answer is
0 everywhere, which is speculation off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from kvfleet.worker.step_cost.model import StepCostModel, StepShape

DECAY = 0.8  # weight of the past in a row's acceptance counts, per step it verifies
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0  # an unseen row starts at rate 1/2


class Acceptance:
    """One sequence's recent acceptance: decayed counts of drafted and accepted tokens.

    While a row drafts nothing its counts decay toward the prior, so a row that stopped
    speculating tries again later (what it copies from may have changed).
    """

    __slots__ = ("accepted", "drafted")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.drafted = 0.0

    @property
    def rate(self) -> float:
        """Expected acceptance per drafted token, in (0, 1)."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.drafted + PRIOR_DRAFTED)

    def observe(self, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` drafts of this row and accepted ``accepted``."""
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted


@dataclass(frozen=True)
class Candidate:
    """A decode row that could carry drafts: its acceptance ``rate``, the drafts available
    (``max_drafts``) and its computed tokens (its chunk's context)."""

    rate: float
    max_drafts: int
    num_computed_tokens: int


def size_drafts(candidates: Sequence[Candidate], base: StepShape, sampled_rows: int,
                cost: Optional[StepCostModel], tokens_left: int) -> list[int]:
    """Drafts per candidate (same order), within ``tokens_left`` extra tokens in all.

    Args:
        base: the step's shape without any draft (every candidate counted as a decode row).
        sampled_rows: rows that sample a token this step (each counts one expected token).
        cost: the replica's step-cost model (None: every candidate gets its ``max_drafts``).
    """
    drafts = [0] * len(candidates)
    if cost is None:
        for i, c in enumerate(candidates):
            drafts[i] = max(0, min(c.max_drafts, tokens_left))
            tokens_left -= drafts[i]
        return drafts
    rows, prefill, context, verified = base
    tokens = float(sampled_rows)
    seconds = cost.predict_step_s(rows, prefill, context, verified)
    gains = [c.rate for c in candidates]  # expected gain of each row's next draft
    while tokens_left > 0:
        best = max((i for i, c in enumerate(candidates) if drafts[i] < c.max_drafts),
                   key=gains.__getitem__, default=None)
        if best is None:
            break
        new_s = cost.predict_step_s(rows, prefill, context + 1, verified + 1)
        if seconds > 0 and (tokens + gains[best]) * seconds <= tokens * new_s:
            break  # the best remaining draft no longer pays for itself
        drafts[best] += 1
        tokens += gains[best]
        gains[best] *= candidates[best].rate
        context, verified, seconds = context + 1, verified + 1, new_s
        tokens_left -= 1
    return drafts
