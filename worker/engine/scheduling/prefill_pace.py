"""The deadlines the ITL target's floor paces prefills to (:class:`PrefillPace`), and which
prefills it paces (:func:`pending_prefills`, :func:`paced_prefill`). The floor itself is
:meth:`~kvfleet.worker.engine.scheduling.step_budget.StepBudget.pace_queue`; why this rule,
with measurements: docs/slo.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from kvfleet.worker.engine.request import SeqStatus, SequenceState

if TYPE_CHECKING:  # only for annotations (step_budget imports this module)
    from kvfleet.worker.engine.scheduling.step_budget import StepBudget

# A prompt's tokens are paced to be computed within this × their predicted time without the
# target; the client's bound (2×) also has to hold the step in flight at its arrival.
TTFT_STRETCH = 1.75
# A prompt paced alone that step noise put behind (less left than this × its remaining time
# without the target) gets that long from then on, once, rather than all it has left in one
# step, which would be the decode rows' longest gap. Once, and not with a queue behind it, so
# the slack cannot compound into a growing queue.
CATCH_UP_STRETCH = 1.25


def pending_prefills(running: Iterable[SequenceState]) -> list[SequenceState]:
    """The running sequences with more than one token to compute, oldest-admitted first (the
    order a step without the target serves them)."""
    pending = [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
    return sorted(pending, key=lambda s: (s.timing.prefill_started is None,
                                          s.timing.prefill_started or 0.0, s.arrival_seq))


def paced_prefill(running: Iterable[SequenceState], next_waiting: Optional[SequenceState]
                  ) -> Optional[SequenceState]:
    """The prefill the floor paces first: the oldest-admitted running sequence with more than
    one token to compute; with none, ``next_waiting`` (admission's next); None when neither
    exists."""
    pending = pending_prefills(running)
    return pending[0] if pending else next_waiting


class PrefillPace:
    """The deadlines of the prefills the floor paces: ``stretch`` × each prompt's time to
    first token *without* the target, from when it started waiting for prefill. That time is
    read off a virtual schedule of the same prompts without the target: each one starts when
    it started waiting or when the one before it would have ended without the target,
    whichever is later, and lasts the predicted time of its tokens in chunks of the token
    budget (:meth:`StepBudget.untargeted_s`). So a prompt queued behind another, running or
    still waiting for the step's budget, is allowed the wait it would have had without the
    target, never the wait the target itself caused: prefill has to keep up with its
    arrivals. A prompt starts waiting for prefill at its arrival, or, when the queue was held
    up for something else than the step's budget (a seat, blocks, a tenant's share:
    :meth:`admission_stopped`), from the next step planned after that last happened before
    its admission; it waited as long without the target. A recompute after a preemption
    starts at its readmission.

    A running prefill's deadline is fixed when it is first paced; the queue's head, while it
    waits for the step's budget alone, is paced on a provisional one (the same rule, not yet
    in the virtual schedule). Counted in real time: steps slower than predicted (time outside
    the forward, a loaded host) make a prompt late, and a late prompt's floor grows to all it
    has left.

    Raises:
        ValueError: ``stretch`` < 1.
    """

    def __init__(self, stretch: float = TTFT_STRETCH) -> None:
        if not stretch >= 1:
            raise ValueError(f"stretch must be >= 1, got {stretch}")
        self.stretch = stretch
        self._deadlines: dict[tuple[str, int], float] = {}
        self._caught_up: set[tuple[str, int]] = set()  # deadlines moved by the catch-up rule
        self._virtual_end = float("-inf")  # when the last prompt given a deadline would end untargeted
        # the last two steps planned after an admission pass held up for something else
        # than the budget: what waited, waited for that until then
        self._held_up = (float("-inf"), float("-inf"))
        self._held = False  # the last admission pass was held up (see admission_stopped)

    def admission_stopped(self, held_up: bool) -> None:
        """The last step's admission pass left sequences waiting; ``held_up``: for another
        reason than the step's budget (a seat, blocks, a share)."""
        self._held = held_up

    def plan(self, now: float) -> bool:
        """A step is planned at ``now``; returns whether the queue's head waits for the
        step's budget alone (the last pass did not hold it up for something else). A queue
        held up in the last pass waited for that until now."""
        held, self._held = self._held, False
        if held:
            self._held_up = (self._held_up[1], now)
        return not held

    def _start(self, seq: SequenceState, now: float) -> float:
        """When ``seq`` started waiting for prefill (class docstring)."""
        admitted = now if seq.timing.prefill_started is None else seq.timing.prefill_started
        if seq.num_preemptions:
            return admitted if seq.status is SeqStatus.RUNNING else now
        before, last = self._held_up
        held_up = last if last <= admitted else before  # one after its admission: the one before
        return min(admitted, max(seq.timing.arrival, held_up))

    def _deadline(self, seq: SequenceState, budget: StepBudget, now: float) -> tuple[float, float]:
        """``seq``'s deadline and its end in the virtual schedule, were it given one now."""
        started = self._start(seq, now)
        # its allowance is for the prompt as admitted (a prefix hit is not computed)
        first = min(seq.num_cached_tokens or 0, seq.num_computed_tokens)
        end = max(started, self._virtual_end) + budget.untargeted_s(first, seq.num_tokens - first)
        return started + self.stretch * (end - started), end

    def left_s(self, seq: SequenceState, budget: StepBudget, now: float, alone: bool = False) -> float:
        """Seconds left at monotonic time ``now`` before ``seq``'s prompt should be computed
        (negative: late). A running prefill seen for the first time joins the virtual
        schedule, so those first seen together must be asked oldest first
        (:func:`pending_prefills`); a waiting one gets a provisional deadline. ``alone``: no
        other prompt is paced this step; a running one that has fallen behind (less left than
        :data:`CATCH_UP_STRETCH` × its remaining time without the target) then has its
        deadline moved, once, to that much from ``now``."""
        if seq.status is not SeqStatus.RUNNING:
            return self._deadline(seq, budget, now)[0] - now
        key = (seq.seq_id, seq.num_preemptions)
        if key not in self._deadlines:
            self._deadlines[key], self._virtual_end = self._deadline(seq, budget, now)
        if alone and key not in self._caught_up:
            catch_up = CATCH_UP_STRETCH * budget.untargeted_s(seq.num_computed_tokens,
                                                              seq.num_tokens - seq.num_computed_tokens)
            if self._deadlines[key] - now < catch_up:
                self._deadlines[key] = now + catch_up
                self._caught_up.add(key)
        return self._deadlines[key] - now

    def forget_all_but(self, seqs: Iterable[SequenceState]) -> None:
        """Drop the deadlines of prefills not in ``seqs`` (ended, finished or preempted)."""
        keep = {(s.seq_id, s.num_preemptions) for s in seqs}
        for key in [k for k in self._deadlines if k not in keep]:
            del self._deadlines[key]
            self._caught_up.discard(key)
