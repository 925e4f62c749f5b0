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
* a prefill chunk that stops short of its prompt takes no more than it needs: its prompt's
  remaining tokens split evenly over the fewest steps the target allows (a chunk stretched to
  the target that does not save a step only lengthens the decode rows' gaps);
* a **floor** of prefill tokens runs each step even past the target, so a prompt's time to
  first token stays within about ``TTFT_STRETCH`` × its time without the target. Each
  prompt's deadline is that stretch of its time to first token on a virtual schedule of the
  same prompts without the target, from its arrival (:class:`PrefillPace`); the floor is the
  smallest chunk whose steps, at the predicted length of this one, end every prefill in
  progress (and the queue's head while only the step's budget keeps it waiting) by its
  deadline, oldest first (:meth:`StepBudget.pace_queue`). Both times come from the same
  cost model, so its scale cancels; the deadlines are in real time, so a prompt made late
  by steps slower than predicted gets all it has left (paced alone, its deadline first moves
  once to ``CATCH_UP_STRETCH`` × its remaining time from then: :class:`PrefillPace`). The
  floor is the only way
  a step runs past its target. Why this rule, with measurements: docs/slo.md.
* where tenants share the replica (``tenant_share`` < 1), an over-served tenant's prefill gets
  no more than :attr:`StepBudget.fair`'s bound allows (:mod:`.fair_bound`), floor included: its
  prompts wait while a less-served tenant has rows.

Decode rows alone may predict more than the target (many rows, long contexts): the target
then only keeps prefill to its floor. The token count stays a hard limit throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.fair_bound import FairBound
from kvfleet.worker.engine.scheduling.prefill_pace import PrefillPace, pending_prefills
from kvfleet.worker.step_cost.model import StepCostModel, attended

if TYPE_CHECKING:  # only for annotations
    from kvfleet.worker.engine.scheduling.config import SchedulerConfig



class StepBudget:
    """What is left of one step's allowance while the scheduler fills it.

    :meth:`grant` says how many of a chunk's tokens fit (it changes nothing); :meth:`take`
    commits a chunk that was scheduled. ``reserved`` marks a running decode row already
    counted by :meth:`reserve_decodes`. Under a target the floor is set by :meth:`pace`
    after the decode rows are reserved.

    Args:
        max_tokens: ``max_num_batched_tokens``.
        block_size: tokens per KV block (chunk ends are aligned to it under a target).
        cost: the replica's step-cost model; with ``target_s`` None it is not consulted.
        target_s: the ITL target in seconds (None: tokens only).
        floor: prefill tokens this step runs even past the target (default none; :meth:`pace`).

    Raises:
        ValueError: a target without a cost model.
    """

    def __init__(self, max_tokens: int, block_size: int, cost: Optional[StepCostModel] = None,
                 target_s: Optional[float] = None, floor: int = 0) -> None:
        if target_s is not None and cost is None:
            raise ValueError("an ITL target needs a step-cost model")
        self.max_tokens = max_tokens
        self.tokens_left = max_tokens
        self.block_size = block_size
        self.cost = cost
        self.target_s = target_s
        self.floor_left = floor
        self.decode_rows = 0
        self.prefill_tokens = 0
        self.context_tokens = 0
        self.decodes_s = 0.0  # the reserved decode rows' predicted seconds
        # over-served tenants' prefill, bounded within the target (tenant_share < 1; None: not)
        self.fair: Optional[FairBound] = None

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

    def untargeted_s(self, num_computed: int, prompt: int) -> float:
        """Predicted seconds to compute ``prompt`` tokens after ``num_computed`` without the
        target: chunks of the token budget left beside the reserved decode rows, one a step,
        each step with those rows and its time outside the forward."""
        per_step = max(1, self.max_tokens - self.decode_rows)
        total, done = 0.0, 0
        while done < prompt:
            n = min(per_step, prompt - done)
            total += self._with(num_computed + done, n) + self._outside_s()
            done += n
        return total

    def pace(self, num_computed: int, remaining: int, left_s: float) -> int:
        """Set and return the floor for a prompt with ``remaining`` tokens to compute after
        ``num_computed`` that should end within ``left_s`` seconds: the smallest chunk (whole
        blocks, or all that is left) whose steps, each as long as this step's prediction with
        it, end in time; all that is left (within the token budget) when even one step would
        not. Call after :meth:`reserve_decodes`.

        Raises:
            ValueError: ``remaining`` < 0.
        """
        return self.pace_queue(num_computed, [(remaining, left_s)])

    def pace_queue(self, num_computed: int, queue: Sequence[tuple[int, float]]) -> int:
        """Set and return the floor for prompts computed one after another, oldest first:
        ``queue`` holds each one's (tokens to compute, seconds left before it should end);
        the first starts after ``num_computed`` tokens. The floor is the smallest chunk
        with which every prompt ends in time when each step runs that many tokens of the
        queue (:meth:`pace` for the tokens up to and including each prompt; the largest of
        those); a prompt already late asks for all the tokens up to its end (within the
        token budget). Call after :meth:`reserve_decodes`.

        Raises:
            ValueError: a prompt with < 0 tokens.
        """
        if any(n < 0 for n, _ in queue):
            raise ValueError(f"remaining tokens must be >= 0, got {list(queue)}")
        if not self.timed:
            return self.floor_left
        floor, through = 0, 0
        for n, left_s in queue:
            through += n
            if through > 1:
                floor = max(floor, self._paced(num_computed, through, left_s))
        self.floor_left = min(floor, self.tokens_left) if through > 1 else self.floor_left
        return self.floor_left

    def _paced(self, num_computed: int, remaining: int, left_s: float) -> int:
        """The smallest chunk whose steps compute ``remaining`` tokens within ``left_s``."""
        # k steps of ceil(remaining / k) tokens (block-rounded): fewer steps, longer each;
        # their total grows with k, so search for the most steps that still end in time.
        lo, hi = 1, max(1, -(-remaining // self.block_size))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._steps_s(num_computed, remaining, mid) <= left_s:
                lo = mid
            else:
                hi = mid - 1
        return self._chunk(num_computed, remaining, lo)

    def grant(self, num_computed: int, want: int, reserved: bool = False,
              seq: Optional[SequenceState] = None) -> int:
        """Tokens (0..``want``) of a chunk starting after ``num_computed`` tokens that fit
        (``seq``: the chunk's sequence, for :attr:`fair`'s bound; None: not bounded)."""
        cap = min(want, self.tokens_left)
        if not self.timed or cap <= 0 or reserved:
            cap = max(cap, 0)
            if self.fair is not None and seq is not None and not reserved and cap > 0:
                cap = self._align(num_computed, self.fair.cap(seq, num_computed, cap), want)
            return cap
        floor = min(cap, self.floor_left)
        n = self._align(num_computed, max(self._fits(num_computed, cap), floor), want)
        if n > floor and self._with(num_computed, n) > self._target():
            # aligned down to one token (a 1-token chunk costs a decode row): the floor only
            n = self._align(num_computed, floor, want)
        if floor < n < want:  # no longer than the fewest steps the target allows need
            even = self._chunk(num_computed, want, -(-want // n))
            n = max(self._align(num_computed, floor, want), min(n, even))
        if self.fair is not None and seq is not None and n > 0:  # the shorter allowance
            n = min(n, self._align(num_computed, self.fair.cap(seq, num_computed, n), want))
        return n

    def take(self, num_computed: int, n: int, reserved: bool = False,
             seq: Optional[SequenceState] = None) -> None:
        """Commit a scheduled chunk of ``n`` tokens after ``num_computed`` (of ``seq``)."""
        self.tokens_left -= n
        if self.fair is not None and seq is not None and not reserved:
            self.fair.take(seq, num_computed, n)
        if self.timed and not reserved:
            self._add(num_computed, n)
            self.floor_left = max(0, self.floor_left - n)

    # ---- helpers -------------------------------------------------------------------------
    def _align(self, num_computed: int, n: int, want: int) -> int:
        """``n`` ended on a block boundary (rounded down) when it stops short of ``want`` and
        a boundary lies inside it (a whole block is what the prefix cache can share)."""
        if 0 < n < want:
            aligned = (num_computed + n) // self.block_size * self.block_size - num_computed
            return aligned if aligned > 0 else n
        return n

    def _chunk(self, num_computed: int, remaining: int, steps: int) -> int:
        """``remaining`` tokens after ``num_computed`` split over ``steps`` steps: the first
        chunk, ended on a block boundary (rounded up; all of ``remaining`` when less)."""
        per = -(-remaining // steps)
        end = -(-(num_computed + per) // self.block_size) * self.block_size
        return min(remaining, end - num_computed)

    def _steps_s(self, num_computed: int, remaining: int, steps: int) -> float:
        """Predicted seconds of ``remaining`` tokens run in chunks of :meth:`_chunk`'s size
        beside this step's decode rows, each chunk attending the prefix before it and each
        decode row one more position a step, and each step its time outside the forward."""
        n = self._chunk(num_computed, remaining, steps)
        full = -(-remaining // n) - 1  # chunks of n before the last one
        rows = self.decode_rows
        last = self._with(num_computed + full * n, remaining - full * n, full * rows)
        # the full chunks differ only in positions attended, which the form prices linearly:
        # their sum is their count times the mean of the first and the last
        if full:
            first, final = self._with(num_computed, n), self._with(
                num_computed + (full - 1) * n, n, (full - 1) * rows)
            last += full * (first + final) / 2
        return last + (full + 1) * self._outside_s()

    def _outside_s(self) -> float:
        """Seconds a step costs beyond its forward, as the model has measured (0 if not)."""
        return float(getattr(self.cost, "outside_s", 0.0))

    def _add(self, num_computed: int, n: int) -> None:
        if n == 1:
            self.decode_rows += 1
        else:
            self.prefill_tokens += n
        self.context_tokens += attended(num_computed, n)

    def _with(self, num_computed: int, n: int, later: int = 0) -> float:
        """Predicted seconds with a chunk of ``n`` more tokens; ``later``: positions the
        step's other rows attend past this step's (a step planned ahead)."""
        assert self.cost is not None
        rows, prefill = (1, 0) if n == 1 else (0, n)
        return self.cost.predict_step_s(self.decode_rows + rows, self.prefill_tokens + prefill,
                                        self.context_tokens + later + attended(num_computed, n))

    def _target(self) -> float:
        assert self.target_s is not None, "only a timed budget has a target"
        return self.target_s

    def _fits(self, num_computed: int, cap: int) -> int:
        """The most tokens (<= ``cap``) whose chunk keeps the prediction within the target
        (the prediction grows with ``n``: binary search)."""
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._with(num_computed, mid) <= self._target():
                lo = mid
            else:
                hi = mid - 1
        return lo


def step_budget(config: SchedulerConfig, block_size: int, cost: Optional[StepCostModel],
                running: Sequence[SequenceState], next_waiting: Optional[SequenceState],
                sit_out: frozenset[str], now: float,
                pacer: Optional[PrefillPace] = None) -> StepBudget:
    """The allowance of the step planned at monotonic time ``now``: ``max_num_batched_tokens``
    alone without ``config.itl_target_ms``; with it also the target, the running decode rows
    (one token to compute; but those whose seq_id is in ``sit_out``) counted first, and a
    floor that paces the oldest prefill in progress, or ``next_waiting`` (the head of the
    waiting queue) when none is (:func:`paced_prefill`), by ``pacer``'s deadline (a fresh
    one, from ``now``, when None: a nested step's prompts are paced from their own step).

    Raises:
        ValueError: an ITL target without a step-cost model ``cost``.
    """
    target_ms = config.itl_target_ms
    if target_ms is None:
        return StepBudget(config.max_num_batched_tokens, block_size)
    budget = StepBudget(config.max_num_batched_tokens, block_size, cost, target_ms / 1e3)
    budget.reserve_decodes(s.num_computed_tokens for s in running
                           if s.num_tokens - s.num_computed_tokens == 1
                           and s.seq_id not in sit_out)
    pacer = pacer or PrefillPace()
    head_waits_for_budget = pacer.plan(now)
    pending = pending_prefills(running)
    pacer.forget_all_but(pending)
    # every prefill in progress must end by its deadline, the oldest computed first, and so
    # must the queue's head while only the step's budget keeps it waiting
    paced = list(pending)
    if next_waiting is not None and (not pending or head_waits_for_budget):
        paced.append(next_waiting)
    if paced:
        budget.pace_queue(paced[0].num_computed_tokens,
                          [(s.num_tokens - s.num_computed_tokens,
                            pacer.left_s(s, budget, now, alone=len(paced) == 1)) for s in paced])
    return budget
