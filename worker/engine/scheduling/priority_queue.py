"""Priority classes in the scheduler: the waiting queue's order, the batch share cap and
which running sequences a higher class may preempt (``kvfleet.priority``: lower runs first).

* **Order.** The waiting queue is kept sorted by ``(priority, arrival_seq)``: a class is taken
  before any lower one, FCFS within it (the scheduler's tenant fairness then applies within
  a class, see :func:`classes`; a class whose every tenant holds its share passes the free
  seats to the classes below). Running sequences are served in the same
  order, so a higher class's prefill gets the step's token budget first, and a running
  sequence that cannot grow preempts the newest of the lowest class.
* **Preemption.** A waiting sequence that finds no seat or too few blocks may preempt (by
  recompute) running sequences of a strictly *lower* class, streaming ones too (their client
  sees a pause, never a changed token: recompute is exact; measured to cut a higher class's
  TTFT tail beside a flood at a small cost in the lower class's throughput: docs/slo.md).
  Victims go lowest class first, newest first. A sequence already preempted
  :data:`MAX_CLASS_PREEMPTIONS` times for a higher class is no victim any more: it keeps its
  seat until it finishes (or memory runs short), so a long lower-class request is delayed a
  bounded number of times, never without end.
* **Batch share.** Sequences in the ``batch`` band (priority >= 2) run in at most
  ``batch_share × max_num_seqs`` seats (at least one), keeping the rest for higher classes.
* **Headroom.** Beside a lower class, a better one may run in up to ``class_headroom`` seats
  past ``max_num_seqs``, and the first ``class_headroom`` seats of better classes never count
  against a lower one (:meth:`PriorityRules.free_seats`). So an interactive trickle beside a
  batch flood adds its rows to the batch's steps instead of taking a batch row's seat: a
  displaced row costs the batch its share of every step's base for the interactive request's
  life, on top of the interactive prompt's own step (docs/slo.md). One class alone runs in
  ``max_num_seqs`` seats as before; past the headroom a better class preempts as before.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Optional, Sequence

from kvfleet.priority import BATCH
from kvfleet.worker.engine.request import SequenceState

# Class preemptions one sequence may undergo; past them it is not preempted for a class again.
MAX_CLASS_PREEMPTIONS = 2


def order_key(seq: SequenceState) -> tuple[int, int]:
    """Where ``seq`` stands in the waiting queue and the running set: class, then FCFS."""
    return seq.priority, seq.arrival_seq


def insert_waiting(waiting: deque[SequenceState], seq: SequenceState) -> None:
    """Insert ``seq`` into ``waiting`` (sorted by :func:`order_key`) before its equals (the
    samples of one request share an arrival)."""
    key, pos = order_key(seq), len(waiting)
    while pos > 0 and order_key(waiting[pos - 1]) >= key:  # a new arrival: O(1)
        pos -= 1
    waiting.insert(pos, seq)


def classes(waiting: Iterable[SequenceState]) -> Iterator[list[SequenceState]]:
    """The waiting sequences class by class, best first, each in FCFS order (``waiting``
    sorted by :func:`order_key`)."""
    group: list[SequenceState] = []
    for s in waiting:
        if group and s.priority != group[0].priority:
            yield group
            group = []
        group.append(s)
    if group:
        yield group


@dataclass(frozen=True)
class PriorityRules:
    """A replica's class rules (``SchedulerConfig.batch_share`` and ``class_headroom``;
    ``headroom`` None: :func:`default_headroom`).

    Raises ValueError for ``batch_share`` outside (0, 1], ``max_num_seqs`` < 1 or a negative
    ``headroom``.
    """

    max_num_seqs: int
    batch_share: float = 1.0
    headroom: Optional[int] = None

    def __post_init__(self) -> None:
        if not 0 < self.batch_share <= 1:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        headroom = default_headroom(self.max_num_seqs) if self.headroom is None else self.headroom
        if headroom < 0:
            raise ValueError(f"class_headroom must be >= 0, got {headroom}")
        object.__setattr__(self, "headroom", headroom)

    @property
    def seats_past_limit(self) -> int:
        """``headroom`` as resolved at construction: seats a better class may hold past
        ``max_num_seqs`` beside a lower one."""
        assert self.headroom is not None  # resolved in __post_init__
        return self.headroom

    def free_seats(self, priority: int, held: Mapping[int, int]) -> int:
        """Seats a sequence of class ``priority`` may still take, ``held`` being the seats
        taken per class (running sequences and their unforked siblings). One that outranks a
        held seat may fill ``max_num_seqs + headroom`` in all; any other counts the seats of
        better classes only past the first ``headroom`` of them. Negative: over (a nested
        step borrowed seats)."""
        total = sum(held.values())
        if any(p > priority and n for p, n in held.items()):
            return self.max_num_seqs + self.seats_past_limit - total
        better = sum(n for p, n in held.items() if p < priority)
        return self.max_num_seqs + min(self.seats_past_limit, better) - total

    def seats_over(self, held: Mapping[int, int]) -> int:
        """Seats ``held`` (per class) holds past what the rules allow: what the lowest held
        class counts (:meth:`free_seats`) past ``max_num_seqs``; 0 when within them."""
        classes_held = [p for p, n in held.items() if n]
        return max(0, -self.free_seats(max(classes_held), held)) if classes_held else 0

    @property
    def batch_seats(self) -> int:
        """Running seats the ``batch`` band may hold at once."""
        return max(1, int(self.max_num_seqs * self.batch_share))

    def batch_capped(self, seq: SequenceState, group: int, held: int) -> bool:
        """Would admitting ``seq`` (and its ``group - 1`` siblings) put the batch band over its
        seats, ``held`` being the batch-band seats taken now?"""
        return seq.priority >= BATCH and held + group > self.batch_seats

    def victims(self, seq: SequenceState, running: Sequence[SequenceState]
                ) -> list[SequenceState]:
        """The running sequences ``seq`` may preempt, in the order to take them: a strictly
        lower class (a larger number) not yet preempted :data:`MAX_CLASS_PREEMPTIONS` times
        for a class; lowest class first, newest first."""
        eligible = [r for r in running if r.priority > seq.priority
                    and r.class_preemptions < MAX_CLASS_PREEMPTIONS]
        return sorted(eligible, key=order_key, reverse=True)


def default_headroom(max_num_seqs: int) -> int:
    """Seats a better class may run past ``max_num_seqs`` beside a lower one by default: a
    eighth of them, at least one (a trickle's burst beside a flood; more rows on top lengthen
    the flood's steps, which an interactive prompt admitted in a whole step then waits for)."""
    return max(1, max_num_seqs // 8)


def seats_by_class(running: Iterable[SequenceState], pending: Mapping[str, Sequence]
                   ) -> Counter:
    """Seats taken per priority: running sequences and their unforked siblings."""
    held: Counter = Counter()
    for s in running:
        held[s.priority] += 1 + len(pending.get(s.seq_id, ()))
    return held


def batch_held(running: Iterable[SequenceState], pending: dict[str, list[SequenceState]]
               ) -> int:
    """Seats the batch band holds: running batch sequences and their unforked siblings."""
    return sum(1 + len(pending.get(s.seq_id, ())) for s in running if s.priority >= BATCH)
