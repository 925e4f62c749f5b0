"""Per-tenant service counters: which tenant the scheduler admits from next (VTC-style).

A tenant's *service* is the weighted work this replica has computed for it::

    service += PREFILL_WEIGHT × prefill tokens computed + DECODE_WEIGHT × decode tokens

counted after each step from the step's chunks (a chunk of one token is a decode, as in the
cost model, ``worker/executor/cost_model.py``). Tokens served from the prefix cache never
appear in a chunk, so cache hits are free: a tenant whose prompts hit the cache is charged less
for the same requests and so gets more turns. A recompute after preemption is charged (it is
compute); a fork's siblings share the leader's prompt and pay only their own decodes.

The next waiting request comes from the backlogged tenant with the least service (the Virtual
Token Counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI '24). A tenant
that becomes backlogged (arrives, or returns from idle) starts at least at the smallest counter
of the tenants already backlogged — or, when none is, at the highest counter yet (the tenant
that ran alone meanwhile) — less a bounded **credit** (the scheduler's: one step's token
budget of prefill) — so idle time is banked only up to that credit: it cannot come back and
hold the replica for as long as it was away, nor for as long as another ran alone, but a light
tenant that comes back beside a flood is still behind it for its first prompts. Lifted to the
flood's counter exactly, its first prefill would put it ahead, and the next prompt of a
small burst (two arrivals close together) would wait behind the flood's next prefill.

The credit is for a light tenant beside a **flood** (a backlogged tenant asking for more
sequences, running and waiting, than an equal split of the replica's ``seats`` among the
backlogged tenants). Below a flood it is kept. Below a light tenant (or on an idle replica,
below the one that ran alone) it is only lent: the borrower pays it back once it floods itself,
and its counter is then where VTC's lift without a credit would have put it. Else a flood that
starts beside a light tenant that just ran alone would start the credit *behind* it, and for
that credit's worth the light tenant, "served more", would lose every comparison to it: its
prompts held back behind, and riding in, the flood's long prefill steps, which the bound on an
over-served tenant's prefill (``fair_bound.py``) does not shorten while the flood is the tenant
served less. So a light tenant returning beside a flood keeps its credit (a burst past its split
included), two light tenants lend each other theirs, a lag a tenant earned while backlogged is
never taken back, and a newcomer's floor counts the others' counters as without their loans.

Weights: decode 2, prefill 1 (the paper's choice). A decode token costs a whole row of the
batch for one token: on the calibrated CPU model several prefill tokens' worth, on a GPU far
closer to one (decode rows ride along in a memory-bound step); 2 sits between and keeps
long-output tenants from looking free.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from kvfleet.service_weights import DECODE_WEIGHT, PREFILL_WEIGHT


class TenantService:
    """Service counters and the backlog of one replica's tenants.

    :meth:`arrive` / :meth:`leave` count each tenant's unfinished sequences (a tenant with one
    or more is *backlogged*); :meth:`charge` adds computed tokens; :meth:`pick` chooses among
    tenants. Counters never decrease, so they can be exported as monotonic counters.

    Args:
        prefill_weight, decode_weight: service per prefill token computed / decode token.
        credit: service a tenant that becomes backlogged may start below the floor (weighted
            tokens, >= 0; 0: the floor exactly, as in VTC).
        seats: the replica's running seats, whose equal split among the backlogged tenants
            tells a flood (>= 1; None: no tenant floods, and the credit is always kept).

    Raises:
        ValueError: a negative weight or credit, or fewer than one seat.
    """

    def __init__(self, prefill_weight: float = PREFILL_WEIGHT,
                 decode_weight: float = DECODE_WEIGHT, credit: float = 0.0,
                 seats: Optional[int] = None) -> None:
        if prefill_weight < 0 or decode_weight < 0:
            raise ValueError("service weights must be >= 0")
        if not credit >= 0:
            raise ValueError(f"credit must be >= 0, got {credit}")
        if seats is not None and seats < 1:
            raise ValueError(f"seats must be >= 1, got {seats}")
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.credit = credit
        self.seats = seats
        self.service: dict[str, float] = {}  # tenant -> weighted tokens computed
        self._high = 0.0  # the highest counter yet: where a tenant starts on an idle replica
        self._backlog: dict[str, int] = {}    # tenant -> unfinished sequences
        self._lent: dict[str, float] = {}  # backlogged tenant -> credit lent it, to pay back

    def arrive(self, tenant: str, num_seqs: int = 1) -> None:
        """``num_seqs`` sequences of ``tenant`` were queued. A tenant not backlogged until now
        starts at the least service of those that are, or the highest yet when none is, less
        the credit (its own if higher). Credit taken below a tenant that does not flood is lent,
        paid back once the borrower floods (:meth:`floods`)."""
        if tenant not in self._backlog:
            self._backlog[tenant] = 0  # counted in the split of the seats from now
            self._repay()
            # the others' counters as without a loan they may still pay back
            others = {t: self.service.get(t, 0.0) + self._lent.get(t, 0.0)
                      for t in self._backlog if t != tenant}
            floor = min(others.values(), default=self._high)
            self._forget_idle(floor - self.credit)
            own = self.service.get(tenant, 0.0)
            self.service[tenant] = max(own, floor - self.credit)
            lent = max(own, floor) - self.service[tenant]
            if self.seats is not None and lent and not (
                    others and self.floods(min(others, key=others.__getitem__))):
                self._lent[tenant] = lent  # lent below a light tenant (or on an idle replica)
        self._backlog[tenant] += num_seqs
        self._repay()

    def _repay(self) -> None:
        """A tenant lent the credit below a light tenant pays it back once it floods."""
        for t in [t for t in self._lent if self.floods(t)]:
            self.service[t] += self._lent.pop(t)
            self._high = max(self._high, self.service[t])

    def floods(self, tenant: str) -> bool:
        """Does backlogged ``tenant`` ask for more sequences (unfinished: running and waiting)
        than an equal split of ``seats`` among the backlogged tenants? (False where ``seats``
        is None.)"""
        return (self.seats is not None
                and self._backlog.get(tenant, 0) * len(self._backlog) > self.seats)

    def leave(self, tenant: str, num_seqs: int = 1) -> None:
        """``num_seqs`` sequences of ``tenant`` finished (or were refused after arrive)."""
        left = self._backlog.get(tenant, 0) - num_seqs
        assert left >= 0, f"tenant {tenant!r} left more sequences than arrived"
        if left:
            self._backlog[tenant] = left
        else:
            self._backlog.pop(tenant, None)
            self._lent.pop(tenant, None)  # it never flooded: the credit was its to keep

    def charge(self, tenant: str, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        """Add computed tokens (cached prompt tokens are never passed here)."""
        s = self.service.get(tenant, 0.0) + self.cost(prefill_tokens, decode_tokens)
        self.service[tenant] = s
        self._high = max(self._high, s)

    def cost(self, prefill_tokens: int = 0, decode_tokens: int = 0) -> float:
        """The service ``prefill_tokens`` computed and ``decode_tokens`` generated are worth."""
        return self.prefill_weight * prefill_tokens + self.decode_weight * decode_tokens

    def pick(self, tenants: Iterable[str],
             planned: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """The tenant of ``tenants`` with the least service (plus ``planned``: service already
        scheduled in the step being planned, not yet charged); ties go to the first listed
        (the caller lists them oldest waiting first). None for no tenants."""
        planned = planned or {}
        best, best_s = None, 0.0
        for t in tenants:
            s = self.service.get(t, 0.0) + planned.get(t, 0.0)
            if best is None or s < best_s:
                best, best_s = t, s
        return best

    def is_backlogged(self, tenant: str) -> bool:
        return tenant in self._backlog

    def served_more(self, a: str, b: str) -> bool:
        """Has tenant ``a`` been served strictly more than tenant ``b`` (:func:`served_more`)?"""
        return served_more(self.service, a, b)

    def behind(self, tenant: str, others: Iterable[str]) -> bool:
        """Has one of ``others`` been served strictly more than ``tenant``?"""
        return any(self.served_more(t, tenant) for t in others)

    def _forget_idle(self, floor: float) -> None:
        """Drop idle tenants at or below ``floor``: coming back they start there anyway, so the
        table holds only backlogged tenants and those ahead of them (it cannot grow without
        bound with tenants that came once)."""
        for t in [t for t, s in self.service.items() if s <= floor and t not in self._backlog]:
            del self.service[t]

    def check_invariants(self) -> None:
        """Every backlogged tenant has a counter and a positive sequence count; credit is lent
        only to backlogged tenants, within the credit, and paid back by one that floods."""
        for t, n in self._backlog.items():
            assert n > 0 and t in self.service, f"tenant {t!r}: backlog {n}"
        for t, lent in self._lent.items():
            assert t in self._backlog and 0 < lent <= self.credit, f"tenant {t!r}: lent {lent}"
            assert not self.floods(t), f"tenant {t!r} floods with lent credit {lent}"


def served_more(service: Mapping[str, float], a: str, b: str) -> bool:
    """Has tenant ``a`` been served strictly more than tenant ``b`` in ``service`` (weighted
    tokens per tenant; a tenant not listed has 0)? False for ``a == b``: the one comparison
    behind every "a less-served tenant of the same class goes first" rule."""
    return service.get(a, 0.0) > service.get(b, 0.0)
