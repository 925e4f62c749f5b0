"""Preemption by class: before a step, waiting sequences of a higher class take seats and
blocks from running ones of a lower class; seats a nested step borrowed go back; and where
seats are divided among tenants, a less-served tenant's prompt takes a seat from a more-served
tenant of its class (:func:`preempt_for_behind_tenant`), and a tenant that asks no more than its
seat share goes first and takes back a seat lent past another's share (:func:`preempt_for_share`).

Under the ``watermark`` policy, a waiting sequence that :func:`~.admission.try_admit` refuses
for seats or blocks (``CLAIM`` mode: nothing is admitted here) preempts, by recompute, running
sequences of a lower class (:meth:`~.priority_queue.PriorityRules.victims`), one at a time,
lowest class and newest first, until it fits. Waiting sequences are served in queue order (best class first,
FCFS) and the seats and blocks each claims are counted for the next, so a burst of
higher-class arrivals gets its seats in one step, not one a step — up to the step's token
budget: it stops once the first chunks claimed fill ``max_num_batched_tokens``. A sequence
refused for any other reason (its tenant's share, the batch share) stops it: admission would
refuse it too. A sequence preempted for a class
:data:`~.priority_queue.MAX_CLASS_PREEMPTIONS` times is no victim any more (its class's
aging: a long lower-class prompt is delayed a bounded number of times).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.admission import (
    ClaimBudget,
    Held,
    Mode,
    Pass,
    Refusal,
    StepWork,
    try_admit,
)
from kvfleet.worker.engine.scheduling.priority_queue import MAX_CLASS_PREEMPTIONS, seats_by_class
from kvfleet.worker.engine.scheduling.seats import group_size

if TYPE_CHECKING:  # only for annotations: the scheduler imports this module
    from kvfleet.worker.engine.scheduling.scheduler import Scheduler

CURABLE = (Refusal.SEATS, Refusal.BLOCKS)  # what preempting a lower class can free
# Why a sequence was preempted (the scheduler's ``preemptions`` counter, a metric label):
# a running sequence could not grow (memory); a higher class took its seat or blocks, or a
# nested step's borrowed seat went back; a tenant served less took its seat.
BLOCKS, CLASS, TENANT_SEAT = "blocks", "class", "tenant_seat"
REASONS = (BLOCKS, CLASS, TENANT_SEAT)


def preempt_for_higher_class(sched: Scheduler, work: StepWork, now: float) -> list[SequenceState]:
    """Let ``sched``'s waiting sequences, best class first, each take a seat and blocks for its
    first chunk from running sequences of a lower class, preempting them one at a time
    (:meth:`Scheduler.preempt`). Stops at the first that finds no victim or is refused for
    another reason, or once the first chunks claimed fill the step's token budget.

    Returns:
        The sequences preempted, in order (now waiting again).
    """
    preempted: list[SequenceState] = []
    victims = _Victims(sched)
    if not sched.waiting or not victims(sched.waiting[0]):
        return preempted  # the best class waiting has no victim: no class behind it has one
    budget = ClaimBudget(sched.config.max_num_batched_tokens)
    claims = Held(0, 0, Counter())  # what the sequences before this one claimed
    for seq in list(sched.waiting):
        if not budget.has_room:
            break
        while True:
            got = try_admit(sched, seq, budget, _claim_pass(sched, claims, work, now, victims))
            if not isinstance(got, Refusal):
                claims.take(seq, group_size(seq, sched.pending_forks), got.new_blocks)
                break
            found = victims(seq) if got in CURABLE else []
            if not found:
                return preempted
            preempt_for_class(sched, found[0])
            preempted.append(found[0])
            victims.clear()  # the running set changed
    return preempted


class _Victims:
    """:meth:`PriorityRules.victims` of each sequence over today's running set, looked up once
    until :meth:`clear` (the running set changed)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._found: dict[str, list[SequenceState]] = {}

    def __call__(self, seq: SequenceState) -> list[SequenceState]:
        if seq.seq_id not in self._found:
            self._found[seq.seq_id] = self.sched.rules.victims(seq, self.sched.running)
        return self._found[seq.seq_id]

    def clear(self) -> None:
        self._found.clear()


def _claim_pass(sched: Scheduler, claims: Held, work: StepWork, now: float,
                victims: _Victims) -> Pass:
    """A ``CLAIM`` pass over today's running set plus what was claimed so far."""
    held = Held.of(sched.running, sched.pending_forks)
    held.seats += claims.seats
    held.batch += claims.batch
    held.by_tenant.update(claims.by_tenant)
    held.by_class.update(claims.by_class)
    held.blocks = claims.blocks

    def own_victims(seq: SequenceState) -> int:  # seats its tenant holds that it could take
        return sum(1 for s in victims(seq) if s.tenant == seq.tenant)

    return Pass(Mode.CLAIM, held, work, now, own_victims=own_victims)


def return_seats_over_limit(sched: Scheduler) -> list[SequenceState]:
    """While the running set holds more seats than the class rules allow
    (:meth:`~.priority_queue.PriorityRules.seats_over`: a nested step borrowed some,
    :mod:`kvfleet.worker.engine.layer_yield`), preempt, by recompute, the victims the best
    running class may take (lowest class, newest first). Returns them (waiting again)."""
    preempted: list[SequenceState] = []
    while sched.running and sched.rules.seats_over(seats_by_class(sched.running,
                                                                  sched.pending_forks)):
        best = min(sched.running, key=lambda s: (s.priority, s.arrival_seq))
        victims = sched.rules.victims(best, sched.running)
        if not victims:
            break  # nothing the class rules allow: the seat comes back when one finishes
        preempt_for_class(sched, victims[0])
        preempted.append(victims[0])
    return preempted


def preempt_for_class(sched: Scheduler, victim: SequenceState, reason: str = CLASS) -> None:
    """Preempt running ``victim`` by recompute for a higher class (``reason`` :data:`CLASS`)
    or a tenant behind (:data:`TENANT_SEAT`), counting it against its bound
    (:data:`~.priority_queue.MAX_CLASS_PREEMPTIONS`)."""
    sched.preempt(victim, reason=reason)
    victim.class_preemptions += 1


def preempt_for_behind_tenant(sched: Scheduler, waited: frozenset[str]) -> list[SequenceState]:
    """A seat for a tenant served less than another of its class, taken from the other's newest
    running sequence rather than waited for (``tenant_share`` < 1, ``watermark``).

    The queue's next pick (:meth:`~.seats.TenantSeats.next_waiting`: the least-served tenant
    that may take a seat) finds every seat held. When it has waited at least one step (its
    ``seq_id`` in ``waited``: it was still waiting when the last step was planned), or no seat
    surely comes back at the end of the step now planned (no running row of its class or a
    lower one samples its last token in it: waiting would cost a whole step, a stalled one on
    a loaded host, for nothing), and a
    running sequence of its class belongs to a tenant served more than its own by more than the
    service's credit (one step's token budget of prefill: :mod:`.tenant_service`), the
    most-served such tenant's newest sequence (the latest arrival, as a memory preemption's
    victim; its full blocks stay cached, so its recompute is mostly prefix hits) is preempted
    by recompute, once more if a nested step left a borrowed seat to return, until the pick's
    seats are free. Never a sequence of a tenant served less, the same or within the credit
    more, so two backlogged tenants whose counters cross step by step do not take seats back
    and forth; a sequence preempted :data:`~.priority_queue.MAX_CLASS_PREEMPTIONS` times for a
    class or a tenant is no victim any more. Without it a less-served tenant's
    burst waits for the next natural finish, which on a stalling host is many slow steps
    (docs/slo.md, "A seat for the tenant behind").

    Returns:
        The sequences preempted (now waiting again), at most the pick's seats plus the seats
        held past ``max_num_seqs``.
    """
    if not sched.waiting:
        return []
    pick = sched.seats.next_waiting(sched.waiting, sched.pending_forks,
                                    Counter(s.tenant for s in sched.running), {})
    if pick is None or (pick.seq_id not in waited and _seat_frees(sched, pick)):
        return []
    group = group_size(pick, sched.pending_forks)
    preempted: list[SequenceState] = []
    while (sched.rules.free_seats(pick.priority, seats_by_class(sched.running, sched.pending_forks))
           < group):
        victim = _tenant_victim(sched, pick)
        if victim is None:
            break
        preempt_for_class(sched, victim, TENANT_SEAT)
        preempted.append(victim)
    return preempted


def _seat_frees(sched: Scheduler, pick: SequenceState) -> bool:
    """Will a seat ``pick`` may take surely come back at the end of the step now planned: a
    running row of its class or a lower one samples its last token (``max_tokens``) in it."""
    return any(r.priority >= pick.priority and r.num_tokens - r.num_computed_tokens == 1
               and len(r.output_token_ids) + 1 >= r.params.max_tokens
               for r in sched.running)


def _tenant_victim(sched: Scheduler, pick: SequenceState) -> SequenceState | None:
    """The running sequence ``pick`` may preempt for its seat (:func:`preempt_for_behind_tenant`):
    of ``pick``'s class, of the tenant served most among those served more than ``pick``'s by
    more than the credit, its newest; none whose siblings wait to fork or that hit the preemption bound."""
    service = sched.service.service
    # past the credit a returning tenant starts below the others with: within it the two
    # tenants' counters cross step by step when both are backlogged (no back and forth)
    floor = service.get(pick.tenant, 0.0) + sched.service.credit
    eligible = [r for r in sched.running
                if r.priority == pick.priority and service.get(r.tenant, 0.0) > floor
                and r.class_preemptions < MAX_CLASS_PREEMPTIONS
                and r.seq_id not in sched.pending_forks]
    if not eligible:
        return None
    return max(eligible, key=lambda r: (service.get(r.tenant, 0.0), r.arrival_seq))


def preempt_for_share(sched: Scheduler, waited: frozenset[str]
                      ) -> tuple[list[SequenceState], Optional[SequenceState]]:
    """A seat within its share for a tenant that asks no more than its share (``tenant_share``
    < 1, ``watermark``; tried when :func:`preempt_for_behind_tenant` took nothing): admitted
    first, and where every seat is held, a seat taken back from a tenant running past its own.

    Service orders the queue and lends seats past a share (:mod:`.seats`) on any margin, and
    holds back the prompts of a tenant served more than the step's first (admission's
    ``favour_first``). Within the service credit two tenants' counters cross step by step (a
    flood starting beside a light tenant that ran alone started up to the credit below it,
    until the flood's credit became a loan paid back once it floods: :mod:`.tenant_service`),
    and the light tenant's prompts may lose such comparisons by a few tokens — held back
    beside free seats, or waiting while the flood holds seats lent past its share that only a
    natural finish gave back (:func:`preempt_for_behind_tenant` acts only past the credit;
    docs/slo.md, "B's wait at the flood's start").

    So the share is a guarantee to a tenant that asks no more than it: the oldest waiting
    sequence, of the class the queue serves next (:meth:`~.seats.TenantSeats.next_waiting`), of
    a tenant whose running and waiting sequences together fit its seat share is admission's
    first pick — unless the tenant service would pick is
    behind its tenant by more than the credit (then service decides, as before). Where every
    seat of its class is held it first takes, by recompute, the newest running sequence of the
    same-class tenant furthest past its share — only of a tenant served less than its own by
    no more than the credit — once more if a nested step left a borrowed seat to return, with
    the one-step wait where a seat comes back at the step's end and the bound per sequence
    (:data:`~.priority_queue.MAX_CLASS_PREEMPTIONS`) of :func:`preempt_for_behind_tenant`;
    counted as :data:`TENANT_SEAT`. A tenant asking for more than its share competes by service
    alone, as before: two backlogged tenants keep the seats service lent them.

    Returns:
        ``(preempted, pick)``: the sequences preempted (now waiting again) and the sequence to
        be admission's first pick in this step; ``([], None)`` when the rule does not apply.
    """
    running = Counter(s.tenant for s in sched.running)
    first = sched.seats.next_waiting(sched.waiting, sched.pending_forks, running, {})
    pick = None if first is None else _within_share(sched, running, first.priority)
    if first is None or pick is None:
        return [], None  # the class the queue serves now has no such tenant
    service, credit = sched.service.service, sched.service.credit
    if service.get(first.tenant, 0.0) < service.get(pick.tenant, 0.0) - credit:
        return [], None  # the tenant service picks is behind past the credit: service decides
    need = group_size(pick, sched.pending_forks) - sched.rules.free_seats(
        pick.priority, seats_by_class(sched.running, sched.pending_forks))
    if need <= 0:
        return [], pick
    if pick.seq_id not in waited and _seat_frees(sched, pick):
        return [], None
    victims: list[SequenceState] = []
    for _ in range(need):  # all of them found first: none is preempted for a seat not freed
        victim = _share_victim(sched, pick, running, victims)
        if victim is None:
            return [], None
        running[victim.tenant] -= 1
        victims.append(victim)
    for victim in victims:
        preempt_for_class(sched, victim, TENANT_SEAT)
    return victims, pick


def _within_share(sched: Scheduler, running: Counter, priority: int) -> Optional[SequenceState]:
    """The oldest waiting sequence of class ``priority`` of a tenant whose whole demand fits its
    seat share (``running[tenant]`` seats held plus the seats of all its waiting sequences);
    None if there is none."""
    per_tenant = sched.seats.per_tenant
    demand = running.copy()
    for seq in sched.waiting:
        demand[seq.tenant] += group_size(seq, sched.pending_forks)
    return next((seq for seq in sched.waiting
                 if seq.priority == priority and demand[seq.tenant] <= per_tenant), None)


def _share_victim(sched: Scheduler, pick: SequenceState, running: Counter,
                  taken: list[SequenceState]) -> SequenceState | None:
    """The running sequence ``pick`` may preempt for its seat (:func:`preempt_for_share`): of
    ``pick``'s class, of the tenant furthest past its seat share among those past it and
    served less than ``pick``'s by no more than the credit (``running``: seats per tenant, less
    those ``taken`` already), its newest; none whose siblings wait to fork or that hit the
    preemption bound."""
    service = sched.service.service
    floor = service.get(pick.tenant, 0.0) - sched.service.credit
    per_tenant = sched.seats.per_tenant
    eligible = [r for r in sched.running
                if r.priority == pick.priority and r.tenant != pick.tenant
                and running[r.tenant] > per_tenant and service.get(r.tenant, 0.0) >= floor
                and r.class_preemptions < MAX_CLASS_PREEMPTIONS
                and r.seq_id not in sched.pending_forks and r not in taken]
    if not eligible:
        return None
    return max(eligible, key=lambda r: (running[r.tenant], r.arrival_seq))
