"""Which running sequences sit out a step so that a favoured prefill runs in a short one.

The ITL target (:mod:`.step_budget`) bounds a step's *length*, not its *contents*: an
interactive prompt's step still carries every batch decode row, which can take longer than the
whole prompt (docs/slo.md). Under the target, each step:

1. **Favoured**: of the prefills this step would run — running sequences with more than one
   token to compute, and the waiting sequence the scheduler admits next if a seat is free —
   the one of the best class; within it, the one of the least-served tenant
   (:class:`~.tenant_service.TenantService`, ties to the tenant running fewer sequences).
2. **Outranked**: running and waiting sequences of a strictly lower class, or of the same
   class and another tenant served at least as much as the favoured one's.
3. Outranked **prefill chunks** sit out (they would take the step's token and time budget
   first: running sequences are planned before waiting ones), and no outranked waiting
   sequence is admitted beside the favoured prefill (:meth:`StepContents.holds_back`; waiting
   ones are not counted below: they wait behind it anyway). Outranked **decode rows** run
   only while the step's prediction (the favoured chunk plus the rows kept) stays within
   ``row_slack ×`` the favoured chunk's own; those left out the longest go first.
4. **No starvation**: a sequence that sat out ``max_skips`` steps in a row runs in the next
   whatever the rule says (the token budget aside): it runs at least one step in every
   ``max_skips + 1``, however long favoured prefills last.

A single class and tenant never sit out anything. The rule is part of the ITL target
(``SchedulerConfig.itl_target_ms``); measurements: docs/slo.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.tenant_service import TenantService
from kvfleet.worker.step_cost.model import StepCostModel, attended

MAX_SKIPS = 2  # steps in a row a sequence may sit out (then it runs one)
ROW_SLACK = 1.25  # outranked decode rows kept while the step stays within this × the favoured chunk


def _to_compute(seq: SequenceState) -> int:
    return seq.num_tokens - seq.num_computed_tokens


@dataclass(frozen=True)
class StepContents:
    """What the rule decided for one planned step: the running rows that sit out
    (``sit_out``, seq_ids), its ``favoured`` prefill (None: no rule, or no prefill), and each
    left-out row's steps in a row sat out (``skipped``: the counts the next step starts from);
    ``within_class``: the favoured prefill holds back only tenants of its own class served
    strictly more than its own (a whole step's rule without the ITL target, where classes keep
    their old order and equally served tenants share the step).
    Admission asks :meth:`holds_back` of the same step's waiting sequences."""

    sit_out: frozenset[str] = frozenset()
    favoured: Optional[SequenceState] = None
    skipped: Mapping[str, int] = field(default_factory=dict)
    within_class: bool = False  # held back: only its class's tenants served strictly more

    def holds_back(self, seq: SequenceState, service: TenantService) -> bool:
        """Is waiting ``seq`` kept out of this step (outranked by its favoured prefill)?"""
        fav = self.favoured
        if fav is None or seq is fav:
            return False
        if self.within_class:
            return seq.priority == fav.priority and service.served_more(seq.tenant, fav.tenant)
        return outranks(fav, seq, service)


class ClassStep:
    """The rule above, for one replica (stateless: each step's decision, its sit-out counts
    included, is the :class:`StepContents` it returns).

    Args:
        cost: the replica's step-cost model (seconds of a step of a given shape).
        max_tokens: ``max_num_batched_tokens`` (the largest chunk a prefill may get).
        target_ms: the ITL target, which caps the favoured chunk's predicted step.
        max_skips: steps in a row a sequence may sit out (>= 1).
        row_slack: outranked decode rows are kept while the step's prediction stays within
            this × the favoured chunk's own (>= 1).

    Raises:
        ValueError: ``max_skips`` < 1, ``row_slack`` < 1 or ``target_ms`` <= 0.
    """

    def __init__(self, cost: StepCostModel, max_tokens: int, target_ms: float,
                 max_skips: int = MAX_SKIPS, row_slack: float = ROW_SLACK) -> None:
        if max_skips < 1:
            raise ValueError(f"max_skips must be >= 1, got {max_skips}")
        if not row_slack >= 1:
            raise ValueError(f"row_slack must be >= 1, got {row_slack}")
        if not target_ms > 0:
            raise ValueError(f"target_ms must be > 0, got {target_ms}")
        self.target_s = target_ms / 1e3
        self.cost = cost
        self.max_tokens = max_tokens
        self.max_skips = max_skips
        self.row_slack = row_slack

    def sit_out(self, running: Sequence[SequenceState], candidate: Optional[SequenceState],
                service: TenantService, skipped: Mapping[str, int]) -> StepContents:
        """The step being planned: which of ``running`` sit out, and its favoured prefill.

        ``candidate``: the waiting sequence the scheduler would admit next (None: none can
        be, e.g. no free seat). ``skipped``: the last plan's counts (its
        :attr:`StepContents.skipped`); a sequence not left out this time starts again at 0.
        """
        prefills = [s for s in running if _to_compute(s) > 1]
        if candidate is not None:
            prefills.append(candidate)
        fav = favoured(prefills, running, service)
        out: set[str] = set()
        if fav is not None:
            lower = [s for s in running if s is not fav and outranks(fav, s, service)]
            out = {s.seq_id for s in lower if _to_compute(s) > 1}
            low = {s.seq_id for s in lower}
            rows = [s for s in running if _to_compute(s) == 1]
            out |= self._rows_left_out([s for s in rows if s.seq_id in low],
                                       [s for s in rows if s.seq_id not in low], fav, skipped)
            out = {sid for sid in out if skipped.get(sid, 0) < self.max_skips}
        return StepContents(frozenset(out), fav, {sid: skipped.get(sid, 0) + 1 for sid in out})

    def _rows_left_out(self, rows: list[SequenceState], others: list[SequenceState],
                       fav: SequenceState, skipped: Mapping[str, int]) -> set[str]:
        """Of outranked decode ``rows``, those that do not fit within ``row_slack ×`` the
        favoured chunk's predicted step beside the decode rows that run anyway (``others``);
        kept first: the longest left out, then the oldest."""
        n = min(_to_compute(fav), self.max_tokens)
        context = attended(fav.num_computed_tokens, n)
        chunk_s = min(self.target_s, self.cost.predict_step_s(0, n, context))
        limit, kept = self.row_slack * chunk_s, len(others)
        context += sum(attended(s.num_computed_tokens, 1) for s in others)
        left: set[str] = set()
        for s in sorted(rows, key=lambda r: (-skipped.get(r.seq_id, 0), r.arrival_seq)):
            c = context + attended(s.num_computed_tokens, 1)
            if self.cost.predict_step_s(kept + 1, n, c) <= limit:
                kept, context = kept + 1, c
            else:
                left.add(s.seq_id)
        return left

    def check_invariants(self, skipped: Mapping[str, int],
                         unfinished: Iterable[SequenceState]) -> None:
        """Only sequences left out of the last plan are counted (``skipped``: its counts),
        each 1..``max_skips`` steps; none has finished since (one left out cannot sample),
        though it may have been preempted (``unfinished``: the scheduler's running and
        waiting sequences)."""
        ids = {s.seq_id for s in unfinished}
        for sid, n in skipped.items():
            assert sid in ids and 1 <= n <= self.max_skips, (sid, n)


def favoured(prefills: Sequence[SequenceState], running: Iterable[SequenceState],
             service: TenantService) -> Optional[SequenceState]:
    """Of ``prefills``, the best class's; within it the least-served tenant's (ties: the
    tenant running fewer of ``running``, then the oldest). None for no prefills."""
    if not prefills:
        return None
    top = min(s.priority for s in prefills)
    best = sorted((s for s in prefills if s.priority == top), key=lambda s: s.arrival_seq)
    held = Counter(s.tenant for s in running)
    first: dict[str, SequenceState] = {}
    for s in sorted(best, key=lambda s: held[s.tenant]):  # stable: oldest first per tenant
        first.setdefault(s.tenant, s)
    tenant = service.pick(first)
    return None if tenant is None else first[tenant]


def outranks(fav: SequenceState, other: SequenceState, service: TenantService) -> bool:
    """Does ``fav``'s prefill come before ``other``'s step: a better class, or the same class
    and another tenant whose service is not below ``fav``'s tenant's."""
    if fav.priority != other.priority:
        return fav.priority < other.priority
    return fav.tenant != other.tenant and not service.served_more(fav.tenant, other.tenant)
