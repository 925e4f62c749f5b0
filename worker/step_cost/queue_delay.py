"""Predicted queue delay: how long a request arriving now waits before its prefill can start.

A replica advertises two numbers with its load (``ReplicaLoad.queue_delay_s`` and
``prefill_token_s``) so a router can predict a request's time to first token on it as
``queue_delay_s + uncached prompt tokens × prefill_token_s`` (``router/policy.py``,
``predicted_ttft``). Both come from the scheduler's state turned into seconds by the replica's
step-cost model (:class:`~.model.StepCostModel`).

The scheduler runs a newcomer behind everything already queued (FCFS), so it waits for

1. the **prefill backlog**: prompt tokens not yet computed of running sequences and of waiting
   ones (a waiting sequence's blocks already in the prefix cache, or queued ahead of it by
   another waiting sequence of the same prefix, are counted once), computed in chunks of
   ``max_num_batched_tokens − decode rows`` tokens per step beside today's decode rows;
2. a **seat**: with ``max_num_seqs`` taken it waits until enough running sequences finish
   (their remaining ``max_tokens``, one decode step per token — an upper bound when a stop
   token ends one early), the waiting ones ahead of it taking seats first;
3. with nothing to prefill, on average half of the decode step in flight.

The router knows nothing of the model: a replica at half speed reports twice the seconds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvfleet.worker.step_cost.model import StepCostModel

if TYPE_CHECKING:  # only for annotations: the engine imports this module
    from kvfleet.worker.engine.scheduling.scheduler import Scheduler


@dataclass(frozen=True)
class QueueState:
    """What the forecast reads of a scheduler (token counts; a snapshot, so the forecast is a
    pure function of it).

    ``running_left``: per running sequence, decode steps until ``max_tokens`` ends it;
    ``waiting_steps``: the same, in queue order, for each waiting sequence (its whole
    ``max_tokens``); ``prefill_tokens``: the backlog of item 1; ``context_tokens``: KV positions
    the running sequences hold.
    """

    decode_rows: int
    prefill_tokens: int
    context_tokens: int
    running_left: tuple[int, ...]
    waiting_steps: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int

    @classmethod
    def of(cls, scheduler: "Scheduler") -> "QueueState":
        """Snapshot of ``scheduler`` (call it on the engine thread, between steps)."""
        decode_rows = prefill = context = 0
        running_left = []
        for s in scheduler.running:
            left = s.num_tokens - s.num_computed_tokens
            context += s.num_computed_tokens
            if left > 1:
                prefill += left
            else:
                decode_rows += 1
            running_left.append(max(1, s.params.max_tokens - len(s.output_token_ids)))
        for sibs in scheduler.pending_forks.values():  # seats held beside their leader
            running_left += [s.params.max_tokens for s in sibs]
        prefill += uncached_waiting_tokens(scheduler)
        cfg = scheduler.config
        return cls(decode_rows, prefill, context, tuple(running_left),
                   tuple(s.params.max_tokens for s in scheduler.waiting),
                   cfg.max_num_seqs, cfg.max_num_batched_tokens)


def uncached_waiting_tokens(scheduler: "Scheduler") -> int:
    """Prompt tokens the waiting sequences will compute: blocks neither cached nor queued ahead
    by another waiting sequence, plus each one's tokens past its last full block."""
    kv, bs = scheduler.kv, scheduler.kv.block_size
    if not kv.enable_prefix_caching:
        return sum(s.num_tokens for s in scheduler.waiting)
    ahead: set[bytes] = set()
    total = 0
    for s in scheduler.waiting:
        hashes = s.block_hashes[:max(0, (s.num_tokens - 1) // bs)]
        known = _known_prefix(hashes, lambda h: h in ahead or kv.pool.lookup(h) is not None)
        ahead.update(hashes[known:])
        total += s.num_tokens - known * bs
    return total


def _known_prefix(hashes: Sequence[bytes], known) -> int:
    """Length of the leading run of ``hashes`` for which ``known`` holds, by bisection (a
    chained hash known means its whole prefix is: one lookup per halving, not per block)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if known(hashes[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def predict_queue_delay_s(state: QueueState, step: StepCostModel) -> float:
    """Seconds until a request arriving now could start its prefill (module docstring)."""
    d, ctx = state.decode_rows, state.context_tokens
    chunk = max(1, state.max_num_batched_tokens - d)
    full, rest = divmod(state.prefill_tokens, chunk)
    seconds = full * step.predict_step_s(d, chunk, ctx)
    if rest:
        seconds += step.predict_step_s(d, rest, ctx)
    prefill_steps = full + (1 if rest else 0)
    decode_step = step.predict_step_s(d, 0, ctx) if d else 0.0
    seat = _seat_free_step(state)
    if seat > prefill_steps:
        seconds += (seat - prefill_steps) * decode_step
    if not state.prefill_tokens:
        seconds += 0.5 * decode_step
    return seconds


def _seat_free_step(state: QueueState) -> int:
    """Decode steps until a seat is free for a newcomer: seats free up as running sequences
    reach ``max_tokens``; waiting sequences, in order, take them first."""
    free = state.max_num_seqs - len(state.running_left)
    if free > len(state.waiting_steps):
        return 0
    seats = sorted(state.running_left) + [0] * max(0, free)
    heapq.heapify(seats)
    for steps in state.waiting_steps:
        heapq.heappush(seats, heapq.heappop(seats) + steps)
    return seats[0]


def prefill_token_s(state: QueueState, step: StepCostModel) -> float:
    """Marginal seconds per prompt token of a full prefill chunk beside today's decode rows."""
    d, ctx = state.decode_rows, state.context_tokens
    chunk = max(1, state.max_num_batched_tokens - d)
    return max(0.0, (step.predict_step_s(d, chunk, ctx) - step.predict_step_s(d, 0, ctx)) / chunk)


def throughput_load(state: QueueState, step: StepCostModel) -> float:
    """The share of the replica's throughput in use, plus the queue beyond its seats (in
    seats): ``1 − base·(1 − B/M) / s(B, P) + waiting / M`` for ``B`` sequences running,
    ``M = max_num_seqs``, ``P`` the prompt tokens the next step computes, ``s`` the predicted
    step and ``base`` its fixed part (the linear form's intercept).

    A step's fixed cost is useful only in the share of the seats it serves; the rest of it is
    the capacity left. So the ratio is the useful work per second over the most a replica
    does (1 at full seats): linear in the arrival rate, each request adding its prompt and its
    output tokens' share, which is what scaling by ``n × load / target`` assumes. The seats in
    use (``B / M``) are not: with the measured constants a quarter of the seats already carry
    most of a full replica's tokens/s (docs/operating.md)."""
    rows, seats = len(state.running_left), state.max_num_seqs
    queued = len(state.waiting_steps) / seats
    prefill = min(state.prefill_tokens, max(0, state.max_num_batched_tokens - rows))
    now = step.predict_step_s(rows, prefill, state.context_tokens)
    if now <= 0:
        return queued
    base = max(0.0, 2 * step.predict_step_s(1, 0, 0) - step.predict_step_s(2, 0, 0))
    idle = base * max(0.0, 1 - rows / seats) / now
    return min(1.0, max(0.0, 1 - idle)) + queued


def load_forecast(scheduler: "Scheduler", step: StepCostModel) -> dict[str, float]:
    """``{"queue_delay_s": …, "prefill_token_s": …, "throughput_load": …}`` of ``scheduler``
    now (engine thread)."""
    state = QueueState.of(scheduler)
    return {"queue_delay_s": predict_queue_delay_s(state, step),
            "prefill_token_s": prefill_token_s(state, step),
            "throughput_load": throughput_load(state, step)}
