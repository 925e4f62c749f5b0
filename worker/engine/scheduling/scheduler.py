"""Continuous-batching scheduler: decides each step's plan; the model runner executes it.

Each step (:meth:`Scheduler.schedule`) takes, up to ``max_num_seqs`` sequences and a token
budget (``max_num_batched_tokens``):

1. running sequences first, best class first, oldest first (decodes, and prefills still
   catching up);
2. then waiting sequences, with chunked prefill filling the budget that remains: by class,
   within the best class the oldest of the least-served tenant (fair by service, with a
   per-tenant share of seats: :mod:`.seats`); it stops at the first that does not fit
   (no starvation).

With ``itl_target_ms`` set, the step's predicted time is budgeted too (:mod:`.step_budget`),
and a higher class's or the least-served tenant's prefill runs without the others' rows
(:mod:`.class_step`); a step in flight may pause between layers for a nested step of a
higher class (:mod:`kvfleet.worker.engine.layer_yield.nested`). Admission follows the replica's policy (docs/design.md §3; the block
counts: :mod:`.blocks`):

* ``watermark`` (default): admit when the uncached prompt fits and a free-block watermark
  stays free; when a running sequence cannot grow, preempt the newest running sequence by
  recompute (its blocks are freed; it re-enters the waiting queue at its FCFS position and
  later recomputes prompt + output, reusing whatever prefix blocks are still cached). Before
  a step, waiting sequences of a higher class may preempt lower-class running ones for their
  seats and blocks (:mod:`.preemption`).
* ``reserve``: admit only when blocks for ``prompt + max_tokens`` are free; never preempts.

Priority classes (:mod:`.priority_queue`): the waiting queue and the running set are ordered
by class first (lower ``priority`` first), FCFS within a class; ``batch_share`` caps the seats
the ``batch`` band may hold.

Parallel sampling (``n > 1``): only sample 0 is queued; its siblings fork its blocks once its
prompt is computed, and a shared partial block is copied before a write (:mod:`.forks`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Iterable, Optional

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.errors import ResourceExhausted
from kvfleet.priority import BATCH
from kvfleet.worker.engine.layer_yield.nested import nested_step, return_borrowed_seats
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.blocks import BlockAdmission
from kvfleet.worker.engine.scheduling.class_step import ClassStep
from kvfleet.worker.engine.scheduling.config import SchedulerConfig
from kvfleet.worker.engine.scheduling.forks import drop_sibling, fork_siblings
from kvfleet.worker.engine.scheduling.hit_counts import HitCounts
from kvfleet.worker.engine.scheduling.output import Fork, ScheduledSeq, SchedulerOutput
from kvfleet.worker.engine.scheduling.preemption import preempt_for_higher_class
from kvfleet.worker.engine.scheduling.priority_queue import (
    PriorityRules,
    batch_held,
    insert_waiting,
    order_key,
)
from kvfleet.worker.engine.scheduling.seats import TenantSeats, group_size, seats_taken
from kvfleet.worker.engine.scheduling.step_budget import StepBudget, step_budget
from kvfleet.worker.engine.scheduling.tenant_service import TenantService
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.kv_tier.admission import TierAdmission
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.step_cost.model import StepCostModel

# Admission's first pick when already made this step: (the sequence or None,), or () to pick.
FirstPick = tuple[Optional[SequenceState], ...]


class Scheduler:
    """Owns the waiting queue, the running set and the KV cache manager of one replica.

    ``step_cost`` predicts a step's seconds; required when ``config.itl_target_ms`` is set.
    ``tier``: the node's host KV tier, looked up after the device pool at admission.

    Raises:
        ValueError: an ITL target without a step-cost model.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 step_cost: Optional[StepCostModel] = None,
                 tier: TierLookup | None = None) -> None:
        if config.itl_target_ms is not None and step_cost is None:
            raise ValueError("itl_target_ms needs a step-cost model")
        self.config = config
        self.kv = kv
        self.step_cost = step_cost
        # The host tier: admission restores the blocks it holds after the device pool's.
        self.tier = TierAdmission(kv, tier) if tier is not None else None
        self.hits = HitCounts()  # prompt tokens admitted, hits by tier (metrics)
        if tier is not None:
            kv.pool.record_evictions = True  # evicted blocks are written back first
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        # leader seq_id -> siblings waiting for its prompt to be computed (n > 1)
        self.pending_forks: dict[str, list[SequenceState]] = {}
        self.blocks = BlockAdmission(kv, config.policy, config.watermark)
        self.rules = PriorityRules(config.max_num_seqs, config.batch_share,
                                   config.preempt_streaming)
        self.service = TenantService()  # per-tenant service: who is admitted next
        self.seats = TenantSeats(config.max_num_seqs, config.tenant_share,
                                 config.seats_by_service, self.service)
        self.class_step = (ClassStep(step_cost, config.max_num_batched_tokens, config.itl_target_ms)
                           if step_cost and config.itl_target_ms and config.class_step else None)

    # ---- admission -------------------------------------------------------------------
    def check_can_ever_fit(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Refuse at once what this replica could never finish, even alone.

        Under ``watermark`` each sample must fit alone (siblings can be preempted and run
        one after another); under ``reserve`` all ``n`` must fit together.

        Raises:
            ResourceExhausted: the request needs more blocks (or sequences) than the replica has.
        """
        if n > self.config.max_num_seqs:
            raise ResourceExhausted(
                f"n ({n}) exceeds this replica's max_num_seqs ({self.config.max_num_seqs})")
        self.blocks.check_can_ever_fit(num_prompt_tokens, max_tokens, n)

    def add(self, seqs: Iterable[SequenceState]) -> None:
        """Queue new sequences; those of one request (its ``n`` samples) are kept together,
        the first of them leading (queued; the others fork from it).

        Raises:
            ResourceExhausted: the replica is full (``max_sequences``), or a request can
                never fit (:meth:`check_can_ever_fit`); then nothing was queued.
        """
        groups: dict[str, list[SequenceState]] = {}
        for s in seqs:
            groups.setdefault(s.request_id, []).append(s)
        for g in groups.values():
            self.check_can_ever_fit(g[0].num_prompt_tokens, g[0].params.max_tokens, len(g))
        num_new = sum(len(g) for g in groups.values())
        if self.num_unfinished + num_new > self.config.max_sequences:
            raise ResourceExhausted(
                f"worker queue is full ({self.num_unfinished} running + waiting sequences of "
                f"{self.config.max_sequences})")
        for leader, *siblings in groups.values():
            if siblings:
                self.pending_forks[leader.seq_id] = siblings
            insert_waiting(self.waiting, leader)
            self.service.arrive(leader.tenant, 1 + len(siblings))

    @property
    def num_queued(self) -> int:
        """Sequences not yet running: the waiting queue plus siblings waiting to fork."""
        return len(self.waiting) + sum(len(v) for v in self.pending_forks.values())

    @property
    def num_unfinished(self) -> int:
        return self.num_queued + len(self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, now: Optional[float] = None) -> SchedulerOutput:
        """Plan one engine step at monotonic time ``now`` (default: the clock's). Never
        returns a plan whose blocks are not allocated."""
        now = time.monotonic() if now is None else now
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted = return_borrowed_seats(self)  # a nested step's seats (layer_yield.py)
        if self.config.policy == "watermark":
            preempted += preempt_for_higher_class(self)
        sit_out, first = self._sit_out()
        budget = step_budget(self.config, self.kv.block_size, self.step_cost, self.running,
                             bool(self.waiting), sit_out, now)
        num_preempted = len(preempted)
        self._schedule_running(budget, sit_out, scheduled, preempted, copies)
        if len(preempted) > num_preempted:
            first = ()  # the running set and the queue changed since the pick: pick again
        self._schedule_waiting(budget, now, scheduled, first)
        chunks = tuple(s.chunk(self.kv.block_table(s.seq.seq_id)) for s in scheduled)
        saves, restores = ((tuple(self.kv.take_evictions()), self.tier.take_restores())
                           if self.tier else ((), ()))
        return SchedulerOutput(StepPlan(chunks, tuple(copies), saves, restores),
                               tuple(scheduled), tuple(preempted))

    def schedule_nested(self, paused: SchedulerOutput, now: Optional[float] = None
                        ) -> SchedulerOutput:
        """Plan a nested step to run while ``paused`` (planned by :meth:`schedule`, its
        forward in flight) waits between two layers: only waiting sequences of a class it
        yields to (a lower class in it, nothing better), free blocks only, no preemption,
        none of its sequences touched (:func:`~kvfleet.worker.engine.layer_yield.nested.nested_step`). An empty step
        when none may run (too few blocks or seats, nothing it yields to, a host tier)."""
        return nested_step(self, paused, time.monotonic() if now is None else now)

    def _schedule_running(self, budget: StepBudget, sit_out: frozenset[str],
                          scheduled: list[ScheduledSeq], preempted: list[SequenceState],
                          copies: list[tuple[int, int]]) -> None:
        """Step 1: running sequences, best class first, oldest first (decodes and prefills in
        progress), but those in ``sit_out``; one that cannot grow preempts the newest."""
        i = 0
        self.running.sort(key=order_key)
        while i < len(self.running) and budget.has_room:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = 0 if seq.seq_id in sit_out else budget.grant(
                seq.num_computed_tokens, remaining, reserved=remaining == 1)
            if n <= 0:
                i += 1
                continue
            while not self._grow(seq, seq.num_computed_tokens + n, copies):
                if self.config.policy == "reserve":
                    raise AssertionError("reserve policy ran out of reserved blocks")
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted itself; it is the last one, loop ends
            scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget.take(seq.num_computed_tokens, n, reserved=remaining == 1)
            i += 1

    def _schedule_waiting(self, budget: StepBudget, now: float, scheduled: list[ScheduledSeq],
                          first: FirstPick) -> None:
        """Step 2: waiting sequences by class, the least-served tenant first within it (FCFS
        within one); stop at the first that does not fit (no starvation). ``first``: the
        first pick when already made this step (:meth:`_sit_out`)."""
        seats = seats_taken(self.running, self.pending_forks)
        batch_seats = batch_held(self.running, self.pending_forks)
        running_by_tenant = Counter(s.tenant for s in self.running)
        planned: dict[str, float] = {}  # service admitted this step, charged after it
        while self.waiting and budget.has_room:
            picked = first[0] if first else self.seats.next_waiting(
                self.waiting, self.pending_forks, running_by_tenant, planned)
            first = ()
            if picked is None:
                break  # every waiting tenant holds its share of the running slots
            seq = picked
            if self.class_step and self.class_step.holds_back(seq, self.service):
                break  # a favoured prefill runs in a short step (class_step.py)
            group = group_size(seq, self.pending_forks)
            if seats + group > self.config.max_num_seqs:
                break
            if self.rules.batch_capped(seq, group, batch_seats):
                break  # the batch band holds its share; every sequence behind is batch too
            computed = self.kv.get_computed_blocks(seq.block_hashes, seq.num_tokens)
            hits = self.tier.hits(seq, len(computed)) if self.tier else ()
            num_cached = (len(computed) + len(hits)) * self.kv.block_size
            n = budget.grant(num_cached, seq.num_tokens - num_cached)
            if n <= 0:
                break  # the step's time is spent (its floor too)
            if not self.blocks.admissible(seq, computed, num_cached + n, self.running,
                                          self.pending_forks):
                break
            if not self.admit(seq, computed, hits, n, now):
                break
            running_by_tenant[seq.tenant] += group
            batch_seats += group if seq.priority >= BATCH else 0
            seats += group
            scheduled.append(ScheduledSeq(seq, n, num_cached + n == seq.num_tokens))
            budget.take(num_cached, n)
            planned[seq.tenant] = planned.get(seq.tenant, 0.0) + self.service.cost(prefill_tokens=n)

    def admit(self, seq: SequenceState, computed: list[int], hits: tuple, n: int,
              now: float) -> bool:
        """Move waiting ``seq`` to the running set, reusing its cached blocks ``computed``
        (device pool) and ``hits`` (host tier) and allocating slots for ``n`` more tokens.
        Returns False, changing nothing, when the blocks cannot be allocated."""
        num_cached = (len(computed) + len(hits)) * self.kv.block_size
        if self.kv.allocate_slots(seq.seq_id, num_cached + n, computed) is None:
            return False
        if self.tier:
            self.tier.admitted(seq, len(computed), hits)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        seq.timing.prefill_started = now
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached
            self.hits.admitted(seq.num_tokens, len(computed) * self.kv.block_size,
                               len(hits) * self.kv.block_size)
        self.running.append(seq)
        return True

    def _sit_out(self) -> tuple[frozenset[str], FirstPick]:
        """Running sequences this step leaves out (:class:`ClassStep`; none without it), and
        the waiting sequence the rule took as admission's next pick (``(seq or None,)``;
        ``()`` when it looked none up: no rule, or no free seat)."""
        if self.class_step is None:
            return frozenset(), ()
        if seats_taken(self.running, self.pending_forks) >= self.config.max_num_seqs:
            return self.class_step.sit_out(self.running, None, self.service), ()
        nxt = self.seats.next_waiting(self.waiting, self.pending_forks,
                                      Counter(s.tenant for s in self.running), {})
        return self.class_step.sit_out(self.running, nxt, self.service), (nxt,)

    def _grow(self, seq: SequenceState, num_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Make ``seq``'s table cover ``num_tokens`` positions; first, if the block its next
        token goes into is shared (a fork's partial prompt block), swap in a private copy and
        append ``(src, dst)`` to ``copies``. Returns False, changing nothing, when too few
        blocks are free."""
        cow = self.blocks.pending_copy(seq)
        new = self.blocks.blocks_for(num_tokens) - self.kv.num_blocks(seq.seq_id)
        if new + cow > self.kv.num_free_blocks:
            return False
        if cow and (copy := self.kv.copy_on_write(seq.seq_id)) is not None:
            copies.append(copy)
        allocated = self.kv.allocate_slots(seq.seq_id, num_tokens)
        assert allocated is not None, "free blocks were counted just above"
        return True

    def preempt(self, seq: SequenceState, count: bool = True) -> None:
        """Preempt running ``seq`` by recompute: free its blocks and put it back in FCFS order
        (``count``: as a preemption; a failed tier restore's undo is not one)."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.timing.prefill_started = None  # its recompute is a new prefill
        seq.num_computed_tokens = 0
        seq.num_preemptions += count
        self._requeue(seq)

    def undo_restores(self) -> None:
        """The last plan's tier restores failed on some rank: its restoring sequences wait
        again, to recompute (call :meth:`schedule` again for the step)."""
        if self.tier:
            self.tier.undo(lambda seq: self.preempt(seq, count=False))

    def _requeue(self, seq: SequenceState) -> None:
        insert_waiting(self.waiting, seq)  # back at its class and FCFS position

    # ---- after the forward ---------------------------------------------------------------
    def on_step_done(self, out: SchedulerOutput) -> list[Fork]:
        """Advance counters by what was computed and register newly full blocks.

        Returns the siblings forked this step: those of every leader whose prompt was just
        computed. They are running now, sharing the leader's blocks.
        """
        forks: list[Fork] = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens += s.num_new_tokens
            # Only computed tokens are charged: prefix-cache hits never appear in a chunk.
            if s.num_new_tokens == 1:  # a one-token chunk is a decode (as in the cost model)
                self.service.charge(seq.tenant, decode_tokens=1)
            else:
                self.service.charge(seq.tenant, prefill_tokens=s.num_new_tokens)
            self.kv.cache_full_blocks(seq.seq_id, seq.block_hashes, seq.num_computed_tokens,
                                      from_token=before)
            if s.sample and seq.seq_id in self.pending_forks:
                new = fork_siblings(self.kv, seq, self.pending_forks.pop(seq.seq_id))
                self.running += [f.sibling for f in new]
                forks += new
        return forks

    def finish(self, seq: SequenceState) -> None:
        """Remove a sequence wherever it is and return its blocks (idempotent). A leader that
        ends before its prompt was computed leaves its siblings to run on their own."""
        held = True  # by this scheduler (not, say, still waiting for its adapter)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            held = drop_sibling(self.pending_forks, seq)
        if held:
            self.service.leave(seq.tenant)
        for orphan in reversed(self.pending_forks.pop(seq.seq_id, [])):
            self._requeue(orphan)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
