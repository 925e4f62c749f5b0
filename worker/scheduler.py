"""Continuous-batching scheduler: decides each step's plan; the model runner executes it.

Each step: running sequences first (decodes, and prefills still catching up), then waiting
sequences in FCFS order with chunked prefill filling the remaining token budget
(``max_num_batched_tokens``) up to ``max_num_seqs``. Admission follows the replica's policy
(DESIGN.md §3):

* ``watermark`` (default): admit when the uncached prompt fits and a free-block watermark
  stays free; when a running sequence cannot grow, preempt the newest running sequence by
  recompute (its blocks are freed; it re-enters the waiting queue at its FCFS position and
  later recomputes prompt + output, reusing whatever prefix blocks are still cached).
* ``reserve``: admit only when blocks for ``prompt + max_tokens`` are free; never preempts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.errors import ResourceExhausted
from kvfleet.worker.request import Sequence, SeqStatus
from kvfleet.worker.step_plan import SeqChunk, StepPlan

POLICIES = ("watermark", "reserve")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits of one replica.

    ``watermark`` is the fraction of all blocks kept free when admitting new work under the
    ``watermark`` policy (so running sequences can grow without immediate preemption).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    policy: str = "watermark"
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_waiting < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0, max_waiting >= 0")


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's part of a step. ``sample`` is true when the chunk reaches the sequence's
    last known token, so its logits give the next token."""

    seq: Sequence
    num_new_tokens: int
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    plan: StepPlan
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...] = ()


class Scheduler:
    """Owns the waiting queue, the running set and the KV cache manager of one replica."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._watermark_blocks = int(config.watermark * kv.num_total_blocks)

    # ---- admission -------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.kv.block_size)

    def check_can_ever_fit(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse at once what this replica could never finish, even alone.

        Raises:
            ResourceExhausted: prompt + max_tokens needs more blocks than the replica has.
        """
        need = self.blocks_for(num_prompt_tokens + max_tokens)
        if need > self.kv.num_total_blocks:
            raise ResourceExhausted(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need} KV "
                f"blocks of {self.kv.block_size} tokens; this replica has "
                f"{self.kv.num_total_blocks} in total"
            )

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Queue new sequences (all samples of one request together).

        Raises:
            ResourceExhausted: the waiting queue is full (``max_waiting``).
        """
        seqs = list(seqs)
        if len(self.waiting) + len(seqs) > self.config.max_waiting:
            raise ResourceExhausted(
                f"worker waiting queue is full ({len(self.waiting)}/{self.config.max_waiting})"
            )
        for s in seqs:
            self.check_can_ever_fit(s.num_prompt_tokens, s.params.max_tokens)
        self.waiting.extend(seqs)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one engine step. Never returns a plan whose blocks are not allocated."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # 1. Running sequences, oldest first (decodes and prefills in progress).
        i = 0
        self.running.sort(key=lambda s: s.arrival_seq)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
                victim = self.running[-1]
                if self.config.policy == "reserve":
                    raise AssertionError("reserve policy ran out of reserved blocks")
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted itself; it is the last one, loop ends
            scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
            i += 1

        # 2. Waiting sequences, FCFS; stop at the first that does not fit (no starvation).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq.block_hashes, seq.num_tokens)
            num_cached = len(computed) * self.kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self._admissible(seq, computed, num_cached + n):
                break
            if self.kv.allocate_slots(seq.seq_id, num_cached + n, computed) is None:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n, num_cached + n == seq.num_tokens))
            budget -= n

        chunks = tuple(
            SeqChunk(
                request_id=s.seq.seq_id,
                token_ids=tuple(s.seq.all_token_ids[s.seq.num_computed_tokens:
                                                    s.seq.num_computed_tokens + s.num_new_tokens]),
                num_computed_tokens=s.seq.num_computed_tokens,
                block_table=tuple(self.kv.block_table(s.seq.seq_id)),
            )
            for s in scheduled
        )
        return SchedulerOutput(StepPlan(chunks), tuple(scheduled), tuple(preempted))

    def _admissible(self, seq: Sequence, computed: list[int], num_tokens: int) -> bool:
        """Would admitting ``seq`` (computing up to ``num_tokens``) respect the policy?

        Reused cached blocks that no live request references count as free (they are
        evictable), so taking them uses up free blocks just like allocating new ones.
        """
        unreferenced = sum(1 for b in computed if self.kv.ref_count(b) == 0)
        if self.config.policy == "reserve":
            # Prompt + max_tokens for this one, plus growth already promised to the running ones.
            need = self.blocks_for(seq.max_total_tokens) - len(computed) + unreferenced
            return need + self._outstanding_reservations() <= self.kv.num_free_blocks
        need = self.blocks_for(num_tokens) - len(computed) + unreferenced
        return need + self._watermark_blocks <= self.kv.num_free_blocks

    def _outstanding_reservations(self) -> int:
        """Blocks promised to running sequences under ``reserve`` but not yet allocated."""
        return sum(
            max(0, self.blocks_for(s.max_total_tokens) - self.kv.num_blocks(s.seq_id))
            for s in self.running
        )

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free its blocks and put it back in FCFS order."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        pos = 0
        while pos < len(self.waiting) and self.waiting[pos].arrival_seq < seq.arrival_seq:
            pos += 1
        self.waiting.insert(pos, seq)

    # ---- after the forward ---------------------------------------------------------------
    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance counters by what was computed and register newly full blocks."""
        for s in out.scheduled:
            if s.seq.status is not SeqStatus.RUNNING:
                continue
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.seq.seq_id, s.seq.block_hashes, s.seq.num_computed_tokens)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and return its blocks (idempotent)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
