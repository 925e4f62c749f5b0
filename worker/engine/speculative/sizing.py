"""How many drafts each decode row verifies this step: the count that maximises the step's
expected tokens per predicted second.

A row's ``j``-th draft is modelled as accepted with probability ``f · c^(j-1)``: ``f`` the
chance its first draft is right (how long a match the drafter found says most about it: see
:class:`FirstByMatch`), ``c`` the chance a draft is right once the one before it was (the
row's own runs: copied text is accepted in runs, all or nothing). So ``d`` drafts add
``f · (1 + c + … + c^(d-1))`` expected tokens beside the one it samples anyway. Their price is
the step-cost model's: a decode row that carries ``d`` drafts stays a decode row and adds ``d``
draft tokens, which attend ``d`` more positions (the model's draft term, calibrated on verify
steps and corrected online from every step that verifies drafts; see
:mod:`kvfleet.worker.step_cost.model`). Drafts are handed out best expected gain first, as many
as give the step the most expected tokens ÷ predicted seconds: at a large batch or a low
acceptance rate the answer is 0 everywhere, which is speculation off. On a step of decode rows
only, :class:`QueryRows` keeps the count to what the runner's few-row kernel runs cheaply.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from kvfleet.worker.step_cost.model import StepCostModel, StepShape

DECAY = 0.8  # weight of the past in a row's acceptance counts, per step it verifies
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0  # an unseen row starts at rate 1/2
MATCH_DECAY = 0.95  # weight of the past in a match class's counts, per proposal of the class


class Acceptance:
    """One sequence's recent acceptance: decayed counts of drafted and accepted tokens, and of
    the drafts verified after an accepted one (``followed``) and how many of those were
    accepted (``continued``).

    While a row drafts nothing its counts decay toward the prior, so a row that stopped
    speculating tries again later (what it copies from may have changed).
    """

    __slots__ = ("accepted", "drafted", "continued", "followed")

    def __init__(self) -> None:
        self.accepted = self.drafted = 0.0
        self.continued = self.followed = 0.0

    @property
    def rate(self) -> float:
        """Expected acceptance per drafted token, in (0, 1)."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.drafted + PRIOR_DRAFTED)

    @property
    def continuation(self) -> float:
        """Chance a draft is accepted once the one before it was, in (0, 1): accepted drafts
        after the first ÷ drafts verified after an accepted one (the run's end counted once,
        drafts past it never seen by the model)."""
        return (self.continued + PRIOR_ACCEPTED) / (self.followed + PRIOR_DRAFTED)

    def observe(self, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` drafts of this row and accepted ``accepted``."""
        self.drafted = DECAY * self.drafted + drafted
        self.accepted = DECAY * self.accepted + accepted
        self.continued = DECAY * self.continued + max(0, accepted - 1)
        self.followed = DECAY * self.followed + max(0, min(drafted, accepted + 1) - 1)


class FirstByMatch:
    """The chance a proposal's first draft is accepted, by the length of the match it copies
    from (1, 2, ``top`` or more tokens): decayed counts over the replica's verify rows.

    A one-token match guesses far more often than a four-token one, whatever the row; a class
    whose proposals go undrafted decays toward the prior, so it is tried again later.

    Args:
        top: the longest class (longer matches count as ``top``).
    """

    def __init__(self, top: int = 3) -> None:
        self.top = top
        self._hits = [0.0] * (top + 1)
        self._rows = [0.0] * (top + 1)

    def rate(self, n: int) -> float:
        """First-draft acceptance of a proposal from an ``n``-token match (``n`` ≥ 1)."""
        c = min(n, self.top)
        return (self._hits[c] + PRIOR_ACCEPTED) / (self._rows[c] + PRIOR_DRAFTED)

    def observe(self, n: int, drafted: int, accepted: int) -> None:
        """A proposal from an ``n``-token match: ``drafted`` of it verified (0: not drafted,
        the class drifts toward its prior), ``accepted`` accepted."""
        c = min(n, self.top)
        self._hits[c] = MATCH_DECAY * self._hits[c] + (accepted > 0)
        self._rows[c] = MATCH_DECAY * self._rows[c] + (drafted > 0)


@dataclass(frozen=True)
class Candidate:
    """A decode row that could carry drafts: the chance a draft is accepted once the one
    before it was (``rate``), the drafts available (``max_drafts``), its computed tokens (its
    chunk's context) and the chance its first draft is accepted (``first``; None: ``rate``)."""

    rate: float
    max_drafts: int
    num_computed_tokens: int
    first: Optional[float] = None


@dataclass(frozen=True)
class QueryRows:
    """What a step of decode rows (and their drafts) only, no prefill chunk, costs beyond the
    linear model: each projection runs the step's query rows through a few-row kernel that
    reads every weight once per ``tile`` rows, and past ``limit`` rows through a GEMM that
    costs several such passes. A draft that opens another pass costs a pass over the weights
    (priced as a one-row decode step without context: the weights streamed once), and a
    decode-only step never grows past ``limit`` rows.
    """

    tile: int
    limit: int

    def extra_passes(self, decode_rows: int, drafts: int) -> int | None:
        """Weight passes ``drafts`` drafts add to ``decode_rows`` rows, or None where the step
        would leave the kernel."""
        total = decode_rows + drafts
        if total > self.limit:
            return None
        return -(-total // self.tile) - -(-decode_rows // self.tile)


# The CPU runner's few-row kernel: each thread runs every register tile of rows
# (worker/runner/gemv.c TILE_ROWS) over a weight panel while the panel sits in L2, so the weights
# stream from memory once for all FEW_ROWS rows (worker/runner/models/linear.py; a test keeps
# them equal): one pass. What each further row costs (its FMAs, its attention) is the step-cost
# model's draft term, fitted online, not a pass (docs/speculative.md, the batch-4 ceiling).
CPU_FEW_ROWS = QueryRows(tile=64, limit=64)


def query_rows_for(device: str) -> Optional[QueryRows]:
    """The few-row rule of the runner on ``device`` (a torch device string, e.g. ``"cpu"``,
    ``"cuda:0"``): :data:`CPU_FEW_ROWS` on CPU; None elsewhere (no such kernel there, so
    drafts are priced by the step-cost model alone)."""
    return CPU_FEW_ROWS if device.split(":")[0] == "cpu" else None


def size_drafts(candidates: Sequence[Candidate], base: StepShape, sampled_rows: int,
                cost: Optional[StepCostModel], tokens_left: int,
                query_rows: Optional[QueryRows] = None) -> list[int]:
    """Drafts per candidate (same order), within ``tokens_left`` extra tokens in all.

    The best ``D`` drafts are the ``D`` best expected gains (a row's next draft gains less
    than its last); the answer is the ``D`` with the most expected tokens per predicted
    second, with the weight passes ``query_rows`` says they open on a step without prefill.

    Args:
        base: the step's shape without any draft (every candidate counted as a decode row).
        sampled_rows: rows that sample a token this step (each counts one expected token).
        cost: the replica's step-cost model (None, or one that predicts 0 s: every candidate
            gets its ``max_drafts`` within the budget).
        query_rows: the runner's few-row rule (None: the linear model alone).
    """
    drafts = [0] * len(candidates)
    rows, prefill, context, verified = base
    seconds = 0.0 if cost is None else cost.predict_step_s(rows, prefill, context, verified)
    if cost is None or seconds <= 0:  # nothing priced: the budget alone
        for i, c in enumerate(candidates):
            drafts[i] = max(0, min(c.max_drafts, tokens_left))
            tokens_left -= drafts[i]
        return drafts
    tokens = float(sampled_rows)
    pass_s = cost.predict_step_s(1, 0, 0)
    # (-expected gain of the row's next draft, row): the best draft first
    heap = [(-(c.rate if c.first is None else c.first), i)
            for i, c in enumerate(candidates) if c.max_drafts > 0]
    heapq.heapify(heap)
    best_rate, best_count = tokens / seconds, 0
    path_rate = best_rate
    order: list[int] = []
    while heap and len(order) < tokens_left:
        neg_gain, i = heapq.heappop(heap)
        order.append(i)
        drafts[i] += 1
        if drafts[i] < candidates[i].max_drafts:
            heapq.heappush(heap, (neg_gain * candidates[i].rate, i))
        tokens -= neg_gain
        n = len(order)
        passes: int | None = 0
        if query_rows is not None and prefill == 0:
            passes = query_rows.extra_passes(rows, n)
        if passes is None:
            break
        rate = tokens / (cost.predict_step_s(rows, prefill, context + n, verified + n)
                         + passes * pass_s)
        if rate > best_rate:
            best_rate, best_count = rate, n
        elif rate <= path_rate and (query_rows is None or prefill > 0):
            break  # priced linearly and gains only shrink: the ratio only falls from here
        path_rate = rate
    drafts = [0] * len(candidates)
    for i in order[:best_count]:
        drafts[i] += 1
    return drafts
