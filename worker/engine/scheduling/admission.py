"""Admission: the one routine that says whether a waiting sequence may run in the step being
planned, used by every pass that lets sequences in.

:func:`try_admit` checks one sequence against, in this order: the step's class hold-back (a
favoured prefill runs without the rows it outranks: :mod:`.class_step`), its tenant's share of
the running seats (:class:`~.seats.TenantSeats`), the batch band's share (:class:`~.priority_queue.
PriorityRules`), the free seats, the step's budget (:mod:`.step_budget`) for its first chunk
after its prefix hits (the device pool's, then the host tier's), and the replica's block policy
(:class:`~.blocks.BlockAdmission`). Three passes call it, in three :class:`Mode` s:

* ``STEP``: a whole step's waiting sequences (:func:`admit_waiting`); each that fits is admitted.
* ``NESTED``: a step planned while another one's forward is paused (layer-level yield): the same,
  but no ``n > 1`` request (its siblings fork at the leader's first sample), and seats may be
  borrowed from lower-class running sequences that class preemption could take (they are
  returned at the next whole step: :func:`~.preemption.return_seats_over_limit`).
* ``CLAIM``: class preemption's dry run (:func:`~.preemption.preempt_for_higher_class`): nothing
  is admitted; the seats and free blocks a sequence would take are counted so that the next
  sequence sees them taken, and a refusal for seats or blocks tells the caller to preempt.

Each pass counts what its admissions took in a :class:`Held`, and the step's explicit state
(the block write-backs and tier restores its allocations made) in a :class:`StepWork`.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from kvfleet.allocator.kv_cache_manager import ComputedBlocks
from kvfleet.priority import BATCH
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.class_step import StepContents
from kvfleet.worker.engine.scheduling.output import ScheduledSeq
from kvfleet.worker.engine.scheduling.seats import Forks, group_size

if TYPE_CHECKING:  # annotations only: the scheduler imports this module
    from kvfleet.worker.engine.scheduling.scheduler import Scheduler
    from kvfleet.worker.kv_tier.admission import Restore


class Mode(enum.Enum):
    """Which pass asks (module docstring)."""

    STEP = "step"
    NESTED = "nested"
    CLAIM = "claim"


class Refusal(enum.Enum):
    """Why :func:`try_admit` said no. ``SEATS`` and ``BLOCKS`` can be cured by preempting a
    lower class; the others cannot."""

    HELD_BACK = "held back"        # outranked by the step's favoured prefill
    FORKS = "n > 1"                # a nested step takes no request whose siblings wait to fork
    TENANT_SHARE = "tenant share"  # its tenant holds its share of the running seats
    BATCH_SHARE = "batch share"    # the batch band holds its share
    SEATS = "seats"                # no free seat (max_num_seqs)
    BUDGET = "budget"              # the step's tokens (or time) are spent
    BLOCKS = "blocks"              # the block policy refuses it (or the allocation failed)
    TIER_LOOKUP = "tier lookup"    # its host-tier lookup has not answered yet


class Budget(Protocol):
    """A pass's allowance: :class:`~.step_budget.StepBudget` or :class:`ClaimBudget`."""

    @property
    def has_room(self) -> bool: ...

    def grant(self, num_computed: int, want: int, reserved: bool = False,
              seq: Optional[SequenceState] = None) -> int: ...

    def take(self, num_computed: int, n: int, reserved: bool = False,
             seq: Optional[SequenceState] = None) -> None: ...


class ClaimBudget:
    """Class preemption's allowance: each sequence's first chunk up to ``max_tokens`` tokens,
    until the chunks claimed fill ``max_tokens`` (the step's token budget)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.claimed = 0

    @property
    def has_room(self) -> bool:
        return self.claimed < self.max_tokens

    def grant(self, num_computed: int, want: int, reserved: bool = False,
              seq: Optional[SequenceState] = None) -> int:
        return min(want, self.max_tokens)

    def take(self, num_computed: int, n: int, reserved: bool = False,
             seq: Optional[SequenceState] = None) -> None:
        self.claimed += n


@dataclass
class Held:
    """Running seats a pass counts as taken: the running set's, plus what the pass admitted or
    claimed so far. ``by_tenant`` counts running sequences (a leader's waiting siblings are
    added when its group is admitted); ``blocks``: free blocks claimed (``CLAIM``)."""

    seats: int
    batch: int
    by_tenant: Counter
    blocks: int = 0
    by_class: Counter = field(default_factory=Counter)  # seats per priority

    @classmethod
    def of(cls, running: list[SequenceState], forks: Forks) -> Held:
        seats = batch = 0
        by_class: Counter = Counter()
        for s in running:
            group = group_size(s, forks)
            seats += group
            batch += group if s.priority >= BATCH else 0
            by_class[s.priority] += group
        return cls(seats, batch, Counter(s.tenant for s in running), by_class=by_class)

    def take(self, seq: SequenceState, group: int, blocks: int = 0) -> None:
        self.seats += group
        self.batch += group if seq.priority >= BATCH else 0
        self.by_tenant[seq.tenant] += group
        self.by_class[seq.priority] += group
        self.blocks += blocks


@dataclass
class StepWork:
    """What one planned step's allocations did, handed on explicitly in its plan: cached blocks
    evicted for reuse (``(block, hash)``, to write back before the forward overwrites them;
    None: not recorded, no tier), the host-tier restores admitted, and the tier lookups made
    (one per sequence and step)."""

    evicted: Optional[list[tuple[int, bytes]]] = None  # None: no tier to write back to
    restores: list[Restore] = field(default_factory=list)
    hits: dict[tuple[str, int], Optional[tuple[bytes, ...]]] = field(default_factory=dict)


def _none(seq: SequenceState) -> int:
    return 0


@dataclass
class Pass:
    """One admission pass at monotonic time ``now``: its ``mode``, the seats it counts as held,
    the step's explicit state, the step's contents (its favoured prefill: held-back sequences
    stay out), and the service it admitted per tenant (``planned``: charged after the step,
    counted by the queue's order meanwhile). ``own_victims(seq)``: running sequences of
    ``seq``'s tenant it could preempt (``CLAIM``: its share counts them as given up);
    ``borrowable(seq)``: seats it may borrow past ``max_num_seqs`` (``NESTED``).
    ``stopped_by``: why :func:`admit_waiting` stopped with sequences still waiting (None: it
    did not, or the step's budget had no room left to try)."""

    mode: Mode
    held: Held
    work: StepWork
    now: float
    contents: StepContents = field(default_factory=StepContents)
    planned: dict[str, float] = field(default_factory=dict)
    own_victims: Callable[[SequenceState], int] = _none
    borrowable: Callable[[SequenceState], int] = _none
    stopped_by: Optional[Refusal] = None


@dataclass(frozen=True)
class Admitted:
    """``seq`` runs ``n`` new tokens after ``num_cached`` cached ones (``CLAIM``: would)."""

    seq: SequenceState
    n: int
    num_cached: int
    new_blocks: int

    def scheduled(self) -> ScheduledSeq:
        return ScheduledSeq(self.seq, self.n, self.num_cached + self.n == self.seq.num_tokens)


def try_admit(sched: Scheduler, seq: SequenceState, budget: Budget, p: Pass
              ) -> Admitted | Refusal:
    """May waiting ``seq`` run in the step ``p`` plans, within ``budget``? In ``STEP`` and
    ``NESTED`` modes it is admitted (running, blocks allocated) when it may; in every mode
    ``p.held`` and ``budget`` count what it took. Returns why not otherwise (nothing changed)."""
    config, kv = sched.config, sched.kv
    group = group_size(seq, sched.pending_forks)
    if p.mode is not Mode.CLAIM and p.contents.holds_back(seq, sched.service):
        return Refusal.HELD_BACK
    if p.mode is Mode.NESTED and seq.seq_id in sched.pending_forks:
        return Refusal.FORKS
    if config.tenant_share < 1 and not _tenant_may_take(sched, seq, group, p):
        return Refusal.TENANT_SHARE
    if sched.rules.batch_capped(seq, group, p.held.batch):
        return Refusal.BATCH_SHARE
    if group > sched.rules.free_seats(seq.priority, p.held.by_class) + p.borrowable(seq):
        return Refusal.SEATS
    computed = kv.get_computed_blocks(seq.block_hashes, seq.num_tokens)
    key = (seq.seq_id, len(computed))
    if key not in p.work.hits:
        p.work.hits[key] = sched.tier.hits(seq, len(computed))
    hits = p.work.hits[key]
    if hits is None:
        del p.work.hits[key]  # asked again next time: it may have answered by then
        return Refusal.TIER_LOOKUP
    num_cached = (len(computed) + len(hits)) * kv.block_size
    n = budget.grant(num_cached, sched.blocks.chunk(seq.num_tokens - num_cached), seq=seq)
    if n <= 0:
        return Refusal.BUDGET
    claimed = p.held.blocks if p.mode is Mode.CLAIM else 0
    if not sched.blocks.admissible(seq, computed, num_cached + n, sched.running,
                                   sched.pending_forks, claimed):
        return Refusal.BLOCKS
    new_blocks = sched.blocks.new_blocks(computed, num_cached + n)
    if p.mode is not Mode.CLAIM and not _admit(sched, seq, computed, hits, n, p):
        return Refusal.BLOCKS
    p.held.take(seq, group, new_blocks if p.mode is Mode.CLAIM else 0)
    budget.take(num_cached, n, seq=seq)
    return Admitted(seq, n, num_cached, new_blocks)


def _tenant_may_take(sched: Scheduler, seq: SequenceState, group: int, p: Pass) -> bool:
    """May ``seq``'s tenant take ``group`` more seats (its share, :meth:`~.seats.TenantSeats.
    may_take`)? Seats of its own that this pass could preempt for it (``CLAIM``) count as
    given up, looked up only when needed: fewer seats held never refuses what more allowed."""
    held = p.held.by_tenant[seq.tenant]
    waiting = {s.tenant for s in sched.waiting if s.priority == seq.priority}
    if sched.seats.may_take(seq.tenant, held, group, waiting):
        return True
    own = p.own_victims(seq)
    return bool(own) and sched.seats.may_take(seq.tenant, held - own, group, waiting)


def _admit(sched: Scheduler, seq: SequenceState, computed: list[int] | ComputedBlocks,
           hits: tuple[bytes, ...],
           n: int, p: Pass) -> bool:
    """Move waiting ``seq`` to the running set, reusing its cached blocks ``computed`` (device
    pool) and ``hits`` (host tier, restored before the forward) and allocating slots for ``n``
    more tokens. False, changing nothing, when the blocks cannot be allocated."""
    kv = sched.kv
    num_cached = (len(computed) + len(hits)) * kv.block_size
    if kv.allocate_slots(seq.seq_id, num_cached + n, computed, evicted=p.work.evicted) is None:
        return False
    restore = sched.tier.admitted(seq, len(computed), hits)
    if restore is not None:
        p.work.restores.append(restore)
    sched.waiting.remove(seq)
    seq.status = SeqStatus.RUNNING
    seq.timing.prefill_started = p.now
    seq.num_computed_tokens = num_cached
    if seq.num_cached_tokens is None:
        seq.num_cached_tokens = num_cached
        sched.hits.admitted(seq.num_tokens, len(computed) * kv.block_size, len(hits) * kv.block_size)
    sched.running.append(seq)
    return True


def admit_waiting(sched: Scheduler, budget: Budget, p: Pass,
                  first: tuple[Optional[SequenceState], ...] = (),
                  allow: Callable[[SequenceState], bool] = lambda seq: True,
                  favour_first: bool = False, within_class: bool = False) -> list[ScheduledSeq]:
    """Admit waiting sequences in the queue's order (class, then the least-served tenant:
    :meth:`~.seats.TenantSeats.next_waiting`) while they fit; stop at the first that does not
    (no starvation), or that ``allow`` refuses. ``first``: the first pick when already made
    this step (``(seq or None,)``). ``favour_first``: the first admitted is the step's
    favoured prefill, and those it outranks wait (a nested step's own contents under an ITL
    target; a whole step's with ``tenant_share`` < 1 and no ITL target, ``within_class``:
    only other tenants of its class wait). Returns their chunks, in order."""
    scheduled: list[ScheduledSeq] = []
    # A nested step counts seats with the ones it may borrow: a share of 1 is no cap there.
    check_share = p.mode is not Mode.NESTED or sched.config.tenant_share < 1
    while sched.waiting and budget.has_room:
        picked = first[0] if first else sched.seats.next_waiting(
            sched.waiting, sched.pending_forks, p.held.by_tenant, p.planned, check_share)
        first = ()
        if picked is None or not allow(picked):
            # every waiting tenant holds its share, or a class this pass may not take
            p.stopped_by = Refusal.TENANT_SHARE if picked is None else Refusal.HELD_BACK
            break
        got = try_admit(sched, picked, budget, p)
        if isinstance(got, Refusal):
            p.stopped_by = got
            break
        if favour_first and not scheduled:
            p.contents = StepContents(favoured=picked, within_class=within_class)
        scheduled.append(got.scheduled())
        p.planned[picked.tenant] = (p.planned.get(picked.tenant, 0.0)
                                    + sched.service.cost(prefill_tokens=got.n))
    return scheduled
