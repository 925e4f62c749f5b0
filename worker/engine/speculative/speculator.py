"""Speculative decoding's one seam in the scheduler: which decode rows carry drafts this step,
and what they learnt once verified.

Draft-free methods only (no second model): ``ngram`` copies from the sequence's own prompt
and output (:mod:`.ngram`); ``suffix`` also from recent outputs of the same cache scope
(:mod:`.suffix`), the longer match winning. The drafts travel in the step plan as extra
query tokens of their decode row (``SeqChunk.num_draft_tokens``); the engine verifies them
(:mod:`.verify`) and only then counts them as computed. How many each row carries comes from
the length of the match its drafts copy from (the first draft's chance), the row's recent
runs of accepted drafts (the next's) and the step-cost model (:mod:`.sizing`).

Rows that never speculate: a sequence that opted out (``SamplingParams.speculative``), a
structured-output row (its grammar would have to mask every draft position), a leader whose
siblings fork from this step's logits, and a row with one token left to produce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.speculative.ngram import NgramIndex
from kvfleet.worker.engine.speculative.sizing import (
    CPU_FEW_ROWS,
    Acceptance,
    Candidate,
    FirstByMatch,
    QueryRows,
    size_drafts,
)
from kvfleet.worker.engine.speculative.suffix import SuffixIndex
from kvfleet.worker.step_cost.model import StepCostModel, StepShape

MODES = ("off", "ngram", "suffix")
MAX_DRAFT_TOKENS = 16  # a verify chunk stays small beside a prefill chunk
# Own-sequence n-gram lengths: down to one token (a guess sizing prices by its own, lower, first
# draft chance: see sizing.FirstByMatch), up to four.
NGRAM_MIN, NGRAM_MAX = 1, 4


def check_mode(mode: str, num_tokens: int) -> None:
    """Raises ValueError naming the field: an unknown mode or a draft length out of range."""
    if mode not in MODES:
        raise ValueError(f"speculative must be one of {MODES}, got {mode!r}")
    if not 1 <= num_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"speculative_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {num_tokens}")


@dataclass
class _Row:
    """What the speculator keeps per sequence."""

    ngrams: NgramIndex
    acceptance: Acceptance
    match: int = 0  # the length of the match the row's last planned proposal copied from


@dataclass
class SpecCounts:
    """Replica totals (metrics, ``kvfleet status``): drafted and accepted tokens, verify
    rows, and a histogram of accepted drafts per verify row (index = accepted count)."""

    drafted: int = 0
    accepted: int = 0
    verify_rows: int = 0
    accepted_hist: list[int] | None = None

    def as_dict(self) -> dict:
        return {"spec_drafted_tokens": self.drafted, "spec_accepted_tokens": self.accepted,
                "spec_verify_rows": self.verify_rows,
                "spec_accepted_hist": list(self.accepted_hist or ())}


class Speculator:
    """Drafts for decode rows, per replica (engine thread only).

    Args:
        mode: one of :data:`MODES` (``off``: :meth:`plan` never drafts).
        num_tokens: drafts per row per step at most.
        suffix_tokens: the ``suffix`` index's memory bound, in tokens over all scopes.
        query_rows: the runner's few-row rule for sizing (:class:`~.sizing.QueryRows`; None:
            the step-cost model alone).

    Raises:
        ValueError: see :func:`check_mode`.
    """

    def __init__(self, mode: str = "off", num_tokens: int = 4, suffix_tokens: int = 1 << 18,
                 query_rows: Optional[QueryRows] = CPU_FEW_ROWS) -> None:
        check_mode(mode, num_tokens)
        self.mode = mode
        self.num_tokens = num_tokens
        self.suffix = SuffixIndex(suffix_tokens) if mode == "suffix" else None
        self.query_rows = query_rows
        self.counts = SpecCounts(accepted_hist=[0] * (num_tokens + 1))
        self.first = FirstByMatch()
        self._rows: dict[str, _Row] = {}

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def eligible(self, seq: SequenceState) -> bool:
        """Whether ``seq`` may carry drafts at all (see the module docstring)."""
        return (self.enabled and seq.may_speculate and seq.params.speculative
                and seq.params.max_tokens - len(seq.output_token_ids) > 1)

    def propose(self, seq: SequenceState) -> tuple[int, ...]:
        """Up to ``num_tokens`` drafts continuing ``seq`` (never past its ``max_tokens``); the
        length of the match they copy is kept for sizing (see :meth:`plan`)."""
        n, drafts = self._lookup(seq)
        self._row(seq).match = n if drafts else 0
        return drafts

    def _lookup(self, seq: SequenceState) -> tuple[int, tuple[int, ...]]:
        """``(n, drafts)``: the drafts and the length of the match they copy."""
        k = min(self.num_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        row = self._row(seq)
        tokens = seq.all_token_ids
        own = row.ngrams.propose(tokens, k)
        n_own = row.ngrams.match(tokens)[0] if own else 0
        if self.suffix is None:
            return n_own, own
        n, scoped = self.suffix.propose(seq.root_hash, tokens, k)
        return (n, scoped) if n > n_own or (n == n_own and len(scoped) > len(own)) else (n_own, own)

    def plan(self, rows: Sequence[SequenceState], base: StepShape, sampled_rows: int,
             cost: Optional[StepCostModel], tokens_left: int) -> list[tuple[int, ...]]:
        """Drafts for each of ``rows`` (decode rows this step, all :meth:`eligible`), sized
        by :func:`~.sizing.size_drafts` against ``base`` (the step's shape without drafts)."""
        q = self.query_rows
        if (q is not None and cost is not None and base.prefill_tokens == 0
                and base.decode_rows >= q.limit and cost.predict_step_s(*base) > 0):
            proposals: list[tuple[int, ...]] = [()] * len(rows)  # no room: skip the lookups
        else:
            proposals = [self.propose(s) for s in rows]
        # the match length is 0 where a drafter other than the lookups proposed (tests' oracles):
        # the first draft then gets the row's continuation chance too
        matches = [self._row(s).match if p else 0 for s, p in zip(rows, proposals, strict=True)]
        cands = [Candidate(self._row(s).acceptance.continuation, len(p), s.num_computed_tokens,
                           self.first.rate(n) if n else None)
                 for s, p, n in zip(rows, proposals, matches, strict=True)]
        sizes = size_drafts(cands, base, sampled_rows, cost, tokens_left, self.query_rows)
        for s, n, d in zip(rows, matches, sizes, strict=True):
            row = self._row(s)
            row.match = n
            if d == 0:  # not verifying: drift back toward the prior (see Acceptance)
                row.acceptance.observe(0, 0)
                if n:
                    self.first.observe(n, 0, 0)
        return [p[:d] for p, d in zip(proposals, sizes, strict=True)]

    def verified(self, seq: SequenceState, drafted: int, accepted: int) -> None:
        """The engine verified ``drafted`` drafts of ``seq`` and accepted ``accepted``."""
        row = self._row(seq)
        row.acceptance.observe(drafted, accepted)
        if row.match:
            self.first.observe(row.match, drafted, accepted)
        seq.spec_drafted += drafted
        seq.spec_accepted += accepted
        self.counts.drafted += drafted
        self.counts.accepted += accepted
        self.counts.verify_rows += 1
        hist = self.counts.accepted_hist
        assert hist is not None
        hist[min(accepted, len(hist) - 1)] += 1

    def finished(self, seq: SequenceState) -> None:
        """``seq`` ended: forget it; under ``suffix`` publish its verified tokens to its
        scope (prompt and output: a later request may quote either)."""
        self._rows.pop(seq.seq_id, None)
        if self.suffix is not None and seq.output_token_ids and seq.params.speculative:
            self.suffix.add(seq.root_hash, seq.all_token_ids)

    def _row(self, seq: SequenceState) -> _Row:
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = _Row(NgramIndex(NGRAM_MIN, NGRAM_MAX), Acceptance())
        return row
