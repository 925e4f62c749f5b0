"""A time bound on over-served tenants' prefill while a less-served tenant has rows.

Without an ITL target a step is bounded only by ``max_num_batched_tokens``, with one by the
target; beside a flood of long prompts either fills with the flood's prefill and every step is
long. A less-served
tenant's rows ride in those steps: each of its requests lives as many of them as it has output
tokens, its seats turn over slowly, and its next prompts wait for a seat (docs/slo.md,
"Fairness without the ITL target").

So where seats are divided among tenants (``tenant_share`` < 1), with or without an ITL
target, a step planned while a tenant of some class has running or waiting sequences and another tenant
of the same class has been served strictly more (:class:`~.tenant_service.TenantService`)
gives the over-served tenants' **prefill** chunks (running and admitted alike) at most
``slack ×`` the predicted seconds of the step's decode rows alone (the step-cost model), and
at least ``min_tokens`` of them (one KV block: the flood always progresses). Decode rows are
never cut, nor any chunk of a tenant not over-served: the less-served tenant's own work is
outside the bound. The token budget still holds, and so does the ITL target (a chunk gets the
smaller of the two allowances); the bound only shortens the step.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.tenant_service import served_more
from kvfleet.worker.step_cost.model import StepCostModel, attended

FAIR_SLACK = 0.5  # over-served prefill adds at most this × the decode rows' predicted step


class FairBound:
    """One step's allowance of over-served prefill (mutable while the step is filled).

    Args:
        cost: the replica's step-cost model.
        over: ``(priority, tenant)`` pairs whose prefill is bounded.
        seconds: predicted seconds their prefill chunks may add to the step (>= 0).
        min_tokens: prefill tokens they get each step whatever ``seconds`` says (>= 0).

    Raises:
        ValueError: ``seconds`` or ``min_tokens`` < 0.
    """

    def __init__(self, cost: StepCostModel, over: frozenset[tuple[int, str]], seconds: float,
                 min_tokens: int) -> None:
        if seconds < 0 or min_tokens < 0:
            raise ValueError(f"seconds and min_tokens must be >= 0, got {seconds}, {min_tokens}")
        self.cost = cost
        self.over = over
        self.seconds_left = seconds
        self.min_left = min_tokens

    def applies(self, seq: SequenceState) -> bool:
        """Is ``seq``'s prefill bounded (its tenant over-served in its class)?"""
        return (seq.priority, seq.tenant) in self.over

    def added_s(self, num_computed: int, n: int) -> float:
        """Predicted seconds a prefill chunk of ``n`` tokens after ``num_computed`` adds."""
        if n <= 0:
            return 0.0
        # priced beside one decode row: the step base is paid by the step anyway
        return (self.cost.predict_step_s(1, n, attended(num_computed, n))
                - self.cost.predict_step_s(1, 0, 0))

    def cap(self, seq: SequenceState, num_computed: int, want: int) -> int:
        """The most of ``want`` tokens ``seq``'s chunk may take (``want`` when not bounded)."""
        if want <= 0 or not self.applies(seq):
            return want
        lo, hi = 0, want  # added seconds grow with n: binary search
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.added_s(num_computed, mid) <= self.seconds_left:
                lo = mid
            else:
                hi = mid - 1
        return max(lo, min(want, self.min_left))

    def take(self, seq: SequenceState, num_computed: int, n: int) -> None:
        """Commit ``seq``'s scheduled chunk of ``n`` tokens."""
        if self.applies(seq) and n > 0:
            self.seconds_left = max(0.0, self.seconds_left - self.added_s(num_computed, n))
            self.min_left = max(0, self.min_left - n)


def over_served(seqs: Iterable[SequenceState], service: Mapping[str, float]
                ) -> frozenset[tuple[int, str]]:
    """``(priority, tenant)`` of ``seqs`` whose tenant is served strictly more than another
    tenant with sequences of the same priority among ``seqs``."""
    by_class: dict[int, set[str]] = {}
    for s in seqs:
        by_class.setdefault(s.priority, set()).add(s.tenant)
    out = set()
    for prio, tenants in by_class.items():
        least = min(tenants, key=lambda t: service.get(t, 0.0))
        out |= {(prio, t) for t in tenants if served_more(service, t, least)}
    return frozenset(out)


def fair_bound(cost: Optional[StepCostModel], running: Sequence[SequenceState],
               waiting: Iterable[SequenceState], service: Mapping[str, float],
               min_tokens: int, sit_out: frozenset[str] = frozenset(),
               slack: float = FAIR_SLACK) -> Optional[FairBound]:
    """The bound of the step being planned, or None where nothing is over-served (or there is
    no cost model). The decode rows priced are ``running``'s with one token to compute,
    but those in ``sit_out``.

    Raises:
        ValueError: ``slack`` < 0.
    """
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    if cost is None:
        return None
    over = over_served([*running, *waiting], service)
    if not over:
        return None
    rows = [s for s in running
            if s.num_tokens - s.num_computed_tokens == 1 and s.seq_id not in sit_out]
    decode_s = cost.predict_step_s(len(rows), 0,
                                   sum(attended(s.num_computed_tokens, 1) for s in rows))
    return FairBound(cost, over, slack * decode_s, min_tokens)
