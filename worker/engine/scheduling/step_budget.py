"""One engine step's allowance: a token count, and with an ITL target a predicted time.

Without a target (``itl_target_ms`` unset) a step holds up to ``max_num_batched_tokens`` new
tokens, first come first served — the scheduler as it always was. With one, the step's
*predicted* forward time (:class:`~kvfleet.worker.step_cost.model.StepCostModel`) must also
stay within the target:

* every running decode row is counted first (:meth:`StepBudget.reserve_decodes`): the rows a
  target protects always run, whatever their order among the step's chunks;
* a prefill chunk gets the most tokens that keep the prediction within the target, and ends
  on a KV block boundary when it stops short of its prompt's end (a whole block is what the
  prefix cache can share);
* a **floor** of prefill tokens runs each step even past the target, so a waiting prompt
  always advances: ``block_size × (1 + ⌊wait ÷ (FLOOR_GROWTH × target)⌋)``, the wait
  counted from the admission of the oldest prefill still in progress (not its arrival:
  requests queued for a seat would lift the floor past the token budget and switch the
  target off). Past its first block the floor stops where the step's prediction reaches
  ``FLOOR_CAP`` × the target (or × the decode rows' own predicted time, where longer): the
  floor is the only way a step runs past its target, so it bounds the ITL tail. Why these
  constants, with measurements: docs/slo.md.

Decode rows alone may predict more than the target (many rows, long contexts): the target
then only keeps prefill to its floor. The token count stays a hard limit throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.step_cost.model import StepCostModel, attended

if TYPE_CHECKING:  # only for annotations
    from kvfleet.worker.engine.scheduling.config import SchedulerConfig

FLOOR_GROWTH = 4  # targets of waiting per extra block of floor
# A floor past one block stops where the step's prediction reaches this × the target (or ×
# its decode rows' own time, where they alone take longer).
FLOOR_CAP = 2.0


def floor_tokens(block_size: int, target_s: float, oldest_wait_s: Optional[float],
                 growth: float = FLOOR_GROWTH) -> int:
    """Prefill tokens a step runs past the target: one block, plus one per ``growth``
    targets the oldest prefill in progress has run (``oldest_wait_s``; None: no prefill
    pending, floor 0)."""
    if oldest_wait_s is None:
        return 0
    return block_size * (1 + int(max(0.0, oldest_wait_s) // (growth * target_s)))


class StepBudget:
    """What is left of one step's allowance while the scheduler fills it.

    :meth:`grant` says how many of a chunk's tokens fit (it changes nothing); :meth:`take`
    commits a chunk that was scheduled. ``reserved`` marks a running decode row already
    counted by :meth:`reserve_decodes`.

    Args:
        max_tokens: ``max_num_batched_tokens``.
        block_size: tokens per KV block (chunk ends are aligned to it under a target).
        cost: the replica's step-cost model; with ``target_s`` None it is not consulted.
        target_s: the ITL target in seconds (None: tokens only).
        floor: prefill tokens this step runs even past the target (:func:`floor_tokens`).
        floor_cap: past its first block, the floor stops where the step's prediction reaches
            this × the target (or × the decode rows' own predicted time, where longer).
    """

    def __init__(self, max_tokens: int, block_size: int, cost: Optional[StepCostModel] = None,
                 target_s: Optional[float] = None, floor: int = 0,
                 floor_cap: float = FLOOR_CAP) -> None:
        if target_s is not None and cost is None:
            raise ValueError("an ITL target needs a step-cost model")
        self.tokens_left = max_tokens
        self.block_size = block_size
        self.cost = cost
        self.target_s = target_s
        self.floor_left = floor
        self.floor_cap = floor_cap
        self.decode_rows = 0
        self.prefill_tokens = 0
        self.context_tokens = 0
        self.decodes_s = 0.0  # the reserved decode rows' predicted seconds

    @property
    def timed(self) -> bool:
        return self.target_s is not None

    @property
    def has_room(self) -> bool:
        return self.tokens_left > 0

    def predicted_s(self) -> float:
        """The step's predicted seconds so far (0 without a cost model)."""
        if self.cost is None:
            return 0.0
        return self.cost.predict_step_s(self.decode_rows, self.prefill_tokens, self.context_tokens)

    def reserve_decodes(self, contexts: Iterable[int]) -> None:
        """Count the running decode rows (their computed tokens each) before any chunk."""
        if self.timed:
            for c in contexts:
                self._add(c, 1)
            self.decodes_s = self.predicted_s()

    def grant(self, num_computed: int, want: int, reserved: bool = False) -> int:
        """Tokens (0..``want``) of a chunk starting after ``num_computed`` tokens that fit."""
        cap = min(want, self.tokens_left)
        if not self.timed or cap <= 0 or reserved:
            return max(cap, 0)
        floor = min(cap, self.floor_left)
        if floor > self.block_size:  # past one block, the floor stops at floor_cap targets
            limit = self.floor_cap * max(self._target(), self.decodes_s)
            floor = max(self.block_size, self._fits(num_computed, floor, limit))
        n = max(self._fits(num_computed, cap), floor)
        if 0 < n < want:  # stopping short of the prompt's end: end on a block boundary
            aligned = (num_computed + n) // self.block_size * self.block_size - num_computed
            n = aligned if aligned > 0 else n
        if n > floor and self._with(num_computed, n) > self._target():
            return floor  # aligned down to one token: a 1-token chunk costs a decode row
        return n

    def take(self, num_computed: int, n: int, reserved: bool = False) -> None:
        """Commit a scheduled chunk of ``n`` tokens after ``num_computed``."""
        self.tokens_left -= n
        if self.timed and not reserved:
            self._add(num_computed, n)
            self.floor_left = max(0, self.floor_left - n)

    # ---- helpers -------------------------------------------------------------------------
    def _add(self, num_computed: int, n: int) -> None:
        if n == 1:
            self.decode_rows += 1
        else:
            self.prefill_tokens += n
        self.context_tokens += attended(num_computed, n)

    def _with(self, num_computed: int, n: int) -> float:
        """Predicted seconds with a chunk of ``n`` more tokens."""
        assert self.cost is not None
        rows, prefill = (1, 0) if n == 1 else (0, n)
        return self.cost.predict_step_s(self.decode_rows + rows, self.prefill_tokens + prefill,
                                        self.context_tokens + attended(num_computed, n))

    def _target(self) -> float:
        assert self.target_s is not None, "only a timed budget has a target"
        return self.target_s

    def _fits(self, num_computed: int, cap: int, limit_s: Optional[float] = None) -> int:
        """The most tokens (<= ``cap``) whose chunk keeps the prediction within ``limit_s``
        (default: the target; the prediction grows with ``n``: binary search)."""
        limit = self._target() if limit_s is None else limit_s
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._with(num_computed, mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo


def prefill_wait(running: Iterable[SequenceState], any_waiting: bool, now: float
                 ) -> Optional[float]:
    """Seconds at monotonic time ``now`` since the oldest prefill still in progress among
    ``running`` (a sequence with more than one token to compute) was admitted; 0.0 when
    none is but a sequence waits (``any_waiting``); None when no prefill is pending.

    Counted from admission, not arrival: a queue waiting for seats must not grow the floor,
    or the floor outgrows the step and the target stops acting.
    """
    started = [now if s.timing.prefill_started is None else s.timing.prefill_started
               for s in running if s.num_tokens - s.num_computed_tokens > 1]
    if started:
        return max(0.0, now - min(started))
    return 0.0 if any_waiting else None


def step_budget(config: SchedulerConfig, block_size: int, cost: Optional[StepCostModel],
                running: Sequence[SequenceState], any_waiting: bool, sit_out: frozenset[str],
                now: float) -> StepBudget:
    """The allowance of the step planned at monotonic time ``now``: ``max_num_batched_tokens``
    alone without ``config.itl_target_ms``; with it also the target, the running decode rows
    (one token to compute; but those whose seq_id is in ``sit_out``) counted first, and a
    floor that follows the oldest prefill in progress (:func:`prefill_wait`).

    Raises:
        ValueError: an ITL target without a step-cost model ``cost``.
    """
    target_ms = config.itl_target_ms
    if target_ms is None:
        return StepBudget(config.max_num_batched_tokens, block_size)
    target_s = target_ms / 1e3
    floor = floor_tokens(block_size, target_s, prefill_wait(running, any_waiting, now))
    budget = StepBudget(config.max_num_batched_tokens, block_size, cost, target_s, floor)
    budget.reserve_decodes(s.num_computed_tokens for s in running
                           if s.num_tokens - s.num_computed_tokens == 1
                           and s.seq_id not in sit_out)
    return budget

