"""Priority classes in the scheduler: the waiting queue's order, the batch share cap and
which running sequences a higher class may preempt (``kvfleet.priority``: lower runs first).

* **Order.** The waiting queue is kept sorted by ``(priority, arrival_seq)``: a class is taken
  before any lower one, FCFS within it (the scheduler's tenant fairness then applies among
  the head class only, see :func:`head_class`). Running sequences are served in the same
  order, so a higher class's prefill gets the step's token budget first, and a running
  sequence that cannot grow preempts the newest of the lowest class.
* **Preemption.** A waiting sequence that finds no seat or too few blocks may preempt (by
  recompute) running sequences of a strictly *lower* class, streaming ones too (their client
  sees a pause, never a changed token: recompute is exact; measured to cut a higher class's
  TTFT tail beside a flood at a small cost in the lower class's throughput: docs/slo.md).
  Victims go lowest class first, newest first.
* **Batch share.** Sequences in the ``batch`` band (priority >= 2) run in at most
  ``batch_share × max_num_seqs`` seats (at least one), keeping the rest for higher classes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from kvfleet.priority import BATCH
from kvfleet.worker.engine.request import SequenceState


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


def head_class(waiting: Iterable[SequenceState]) -> Iterator[SequenceState]:
    """The waiting sequences of the best class present, in FCFS order (``waiting`` sorted)."""
    top = None
    for s in waiting:
        if top is None:
            top = s.priority
        elif s.priority != top:
            return
        yield s


@dataclass(frozen=True)
class PriorityRules:
    """A replica's class rules (``SchedulerConfig.batch_share``).

    Raises ValueError for ``batch_share`` outside (0, 1] or ``max_num_seqs`` < 1.
    """

    max_num_seqs: int
    batch_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.batch_share <= 1:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

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
        lower class (a larger number); lowest class first, newest first."""
        eligible = [r for r in running if r.priority > seq.priority]
        return sorted(eligible, key=order_key, reverse=True)


def batch_held(running: Iterable[SequenceState], pending: dict[str, list[SequenceState]]
               ) -> int:
    """Seats the batch band holds: running batch sequences and their unforked siblings."""
    return sum(1 + len(pending.get(s.seq_id, ())) for s in running if s.priority >= BATCH)
