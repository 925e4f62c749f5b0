"""A replica's bound on queued work in seconds: a request that would wait longer than
``max_wait_s`` before its prefill starts is refused on arrival, not queued.

:class:`~kvfleet.worker.service.reservations.Reservations` bounds the queue in sequences; a
count says nothing of time (``max_tokens`` 16 or 4,000, a fast or a slow model). This keeps,
on the event loop and exact at each arrival (a burst arrives between two engine steps), what
the replica's live requests still hold: their sequences, their decode steps (``max_tokens``
each) and the prompt tokens of those not started. A newcomer beyond the ``max_num_seqs``
seats waits for the sequences ahead of it to free one: first-come first-served, seats free
at ``seats / mean steps`` per decode step, so the ``q``-th in the queue waits about
``q × mean steps / seats`` decode steps of a full batch, plus the prompt tokens queued before
it. The step prices are the replica's own step-cost model (``StepCostModel``), so a
slower replica admits less. ``max_wait_s`` is what the replica advertises
(``ReplicaInfo.max_queue_wait_s``); routers treat a replica whose forecast passed it as full.
"""

from __future__ import annotations

from typing import Optional

from kvfleet.errors import ResourceExhausted
from kvfleet.worker.step_cost.model import StepCostModel


class WaitBound:
    """Live requests' remaining work, and the refusal of a request that would wait too long.

    Args:
        max_wait_s: seconds a request may be predicted to wait before its prefill starts
            (> 0; ``float("inf")``: never refused on time).
        seats: sequences a replica runs at once (``max_num_seqs``).
        batched_tokens: tokens one step computes (``max_num_batched_tokens``).
        step: the replica's step-cost predictor.

    Raises:
        ValueError: ``max_wait_s`` <= 0 or ``seats`` < 1.
    """

    def __init__(self, max_wait_s: float, seats: int, batched_tokens: int,
                 step: StepCostModel) -> None:
        if not max_wait_s > 0 or seats < 1:
            raise ValueError(f"max_wait_s ({max_wait_s}) must be > 0 and seats ({seats}) >= 1")
        self.max_wait_s = max_wait_s
        self.seats, self.batched_tokens, self.step = seats, batched_tokens, step
        self._live: dict[str, tuple[int, int, int]] = {}  # id → (sequences, steps, prompt)
        self._started: set[str] = set()
        self.sequences = 0
        self.steps = 0  # decode steps the live sequences may take (max_tokens each)
        self.prompt = 0  # prompt tokens of the live sequences
        self.unstarted_prompt = 0  # prompt tokens of live requests with no output yet

    def wait_s(self) -> float:
        """Predicted seconds before a newcomer's prefill starts: 0 while a seat is free and
        no prompt is queued."""
        rows = min(self.sequences, self.seats)
        context = round(rows * self._mean_context())
        seconds = 0.0
        queued = self.sequences - self.seats + 1  # the newcomer's place in the queue
        if queued > 0:
            mean_steps = self.steps / self.sequences
            decode_s = self.step.predict_step_s(rows, 0, context)
            seconds += queued * mean_steps / self.seats * decode_s
        if self.unstarted_prompt:
            chunk = max(1, self.batched_tokens - rows)
            marginal = (self.step.predict_step_s(rows, chunk, context)
                        - self.step.predict_step_s(rows, 0, context))
            seconds += self.unstarted_prompt / chunk * marginal
        return seconds

    def _mean_context(self) -> float:
        """KV positions a running sequence attends, on average: its prompt and half its
        output."""
        if not self.sequences:
            return 0.0
        return (self.prompt + self.steps / 2) / self.sequences

    def take(self, request_id: str, prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Count ``request_id`` (``n`` sequences of up to ``max_tokens`` steps each).

        Raises:
            ResourceExhausted: it would wait more than ``max_wait_s`` (the message names the
                bound and the prediction); nothing is counted then.
        """
        wait = self.wait_s()
        if self.sequences + n > self.seats and wait > self.max_wait_s:
            raise ResourceExhausted(
                f"replica would start this request in about {wait:.1f} s, past its queue "
                f"bound of {self.max_wait_s:g} s (max_queue_wait_s): {self.sequences} "
                f"sequences ahead of it")
        self._live[request_id] = (n, n * max_tokens, prompt_tokens)
        self.sequences += n
        self.steps += n * max_tokens
        self.prompt += n * prompt_tokens
        self.unstarted_prompt += prompt_tokens

    def started(self, request_id: str) -> None:
        """``request_id`` produced its first output: its prompt is no longer queued."""
        entry = self._live.get(request_id)
        if entry is not None and request_id not in self._started:
            self._started.add(request_id)
            self.unstarted_prompt -= entry[2]

    def release(self, request_id: str) -> None:
        """``request_id`` left (no-op if it holds nothing)."""
        entry: Optional[tuple[int, int, int]] = self._live.pop(request_id, None)
        if entry is None:
            return
        n, steps, prompt = entry
        self.sequences -= n
        self.steps -= steps
        self.prompt -= n * prompt
        if request_id in self._started:
            self._started.discard(request_id)
        else:
            self.unstarted_prompt -= prompt
