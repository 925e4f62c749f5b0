"""Continuous-batching scheduler: decides each step's plan; the model runner executes it.

A step (:meth:`Scheduler.schedule`) is composed of small policies, each in its own module:

1. **preemption** (:mod:`.preemption`): seats a nested step borrowed go back; under
   ``watermark``, waiting sequences of a higher class take seats and blocks from running ones
   of a lower class, and where seats are divided among tenants, a prompt of a tenant served
   less than another of its class (past the service credit) that waited a step, or finds no
   seat coming back at the step's end, takes a seat from the other's newest running sequence;
   a tenant whose whole demand fits its seat share goes first, taking back a seat lent past
   another's share if every seat is held (:func:`~.preemption.preempt_for_share`);
2. **step contents** (:mod:`.class_step`, under an ITL target): which running rows sit out so
   that a favoured prefill runs in a short step;
3. **step budget** (:mod:`.step_budget`): ``max_num_batched_tokens`` tokens, and with
   ``itl_target_ms`` a predicted time; where seats are divided among tenants, with or without
   the target, a time bound on over-served tenants' prefill (:mod:`.fair_bound`);
4. **running** sequences first, best class first, oldest first (decodes, and prefills still
   catching up); one that cannot grow preempts the newest running sequence by recompute (its
   blocks are freed; it re-enters the waiting queue at its class and FCFS position and later
   recomputes prompt + output, reusing whatever prefix blocks are still cached);
5. **admission** (:mod:`.admission`): waiting sequences in the queue's order (by class, then the
   least-served tenant: :mod:`.priority_queue`, :mod:`.seats`, :mod:`.tenant_service`), with
   chunked prefill filling the budget that remains, under the replica's block policy
   (docs/design.md §3; :mod:`.blocks`): ``watermark`` (admit when the first chunk fits beside a
   watermark of free blocks) or ``reserve`` (admit only when blocks for ``prompt +
   max_tokens`` are free; never preempts). It stops at the first that does not fit (no
   starvation).

What a step decided travels with it, never through state read later: the rows that sit out and
the favoured prefill (:class:`~.class_step.StepContents`), the cached blocks its allocations
evicted and the host-tier restores it admitted (:class:`~.admission.StepWork`, in the plan).

Speculative decoding (:mod:`kvfleet.worker.engine.speculative`), when on, runs last: decode
rows may carry drafts in the token budget and free blocks the step left (never a preemption).

Parallel sampling (``n > 1``): only sample 0 is queued; its siblings fork its blocks once its
prompt is computed, and a shared partial block is copied before a write (:mod:`.forks`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable, Iterable, Mapping, Optional

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.errors import ResourceExhausted
from kvfleet.service_weights import PREFILL_WEIGHT
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.admission import (
    Held,
    Mode,
    Pass,
    Refusal,
    StepWork,
    admit_waiting,
)
from kvfleet.worker.engine.scheduling.blocks import BlockAdmission
from kvfleet.worker.engine.scheduling.class_step import ClassStep, StepContents
from kvfleet.worker.engine.scheduling.config import SchedulerConfig
from kvfleet.worker.engine.scheduling.fair_bound import FAIR_SLACK, fair_bound
from kvfleet.worker.engine.scheduling.forks import drop_sibling, fork_siblings
from kvfleet.worker.engine.scheduling.output import Fork, ScheduledSeq, SchedulerOutput
from kvfleet.worker.engine.scheduling.preemption import (
    BLOCKS,
    preempt_for_behind_tenant,
    preempt_for_higher_class,
    preempt_for_share,
    return_seats_over_limit,
)
from kvfleet.worker.engine.scheduling.prefill_pace import PrefillPace
from kvfleet.worker.engine.scheduling.priority_queue import (
    PriorityRules,
    insert_waiting,
    order_key,
    seats_by_class,
)
from kvfleet.worker.engine.scheduling.seats import TenantSeats
from kvfleet.worker.engine.scheduling.step_budget import StepBudget, step_budget
from kvfleet.worker.engine.scheduling.tenant_service import TenantService
from kvfleet.worker.engine.speculative.drafts import add_drafts
from kvfleet.worker.engine.speculative.speculator import Speculator
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.kv_tier.admission import HitCounts, NoTierAdmission, TierAdmission
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.step_cost.model import StepCostModel

# Admission's first pick when already made this step: (the sequence or None,), or () to pick.
FirstPick = tuple[Optional[SequenceState], ...]
__all__ = ["Fork", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


class Scheduler:
    """Owns the waiting queue, the running set and the KV cache manager of one replica.

    ``step_cost`` predicts a step's seconds; required when ``config.itl_target_ms`` is set.
    ``tier``: the node's host KV tier, looked up after the device pool at admission (None: no
    tier). ``class_step`` / ``seats_by_service``: the ITL target's step contents and the tenant
    share's lending, both part of their setting (off only for the virtual-clock benches' A/B);
    ``fair_slack``: the tenant share's bound on over-served prefill, with or without the
    target (:mod:`.fair_bound`; None: off, for the same A/B); ``tenant_preempt``: with the
    tenant share, a seat for the tenant behind (:func:`~.preemption.preempt_for_behind_tenant`;
    off only for the same A/B).

    Raises:
        ValueError: an ITL target without a step-cost model.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 step_cost: Optional[StepCostModel] = None,
                 tier: TierLookup | None = None, *, class_step: bool = True,
                 seats_by_service: bool = True,
                 fair_slack: Optional[float] = FAIR_SLACK, tenant_preempt: bool = True) -> None:
        if config.itl_target_ms is not None and step_cost is None:
            raise ValueError("itl_target_ms needs a step-cost model")
        self.config = config
        self.kv = kv
        self.step_cost = step_cost
        # The host tier: admission restores the blocks it holds after the device pool's.
        self.tier: TierAdmission | NoTierAdmission = (
            TierAdmission(kv, tier) if tier is not None else NoTierAdmission())
        self.hits = HitCounts()  # prompt tokens admitted, hits by tier (metrics)
        self.priorities_seen: set[int] = set()  # of every request queued (layer yield's auto)
        self.tenants_seen: set[str] = set()  # the first two tenants queued (idem)
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        # leader seq_id -> siblings waiting for its prompt to be computed (n > 1)
        self.pending_forks: dict[str, list[SequenceState]] = {}
        self.blocks = BlockAdmission(kv, config.policy, config.watermark,
                                     lambda: self.config.max_num_batched_tokens,
                                     min_chunk=1 + config.speculative_tokens)
        self.spec = Speculator(config.speculative, config.speculative_tokens)
        self.rules = PriorityRules(config.max_num_seqs, config.batch_share, config.class_headroom)
        # per-tenant service: who is admitted next; a returning tenant may start up to one
        # step's prefill behind a tenant asking for more than its split of the seats
        self.service = TenantService(credit=config.max_num_batched_tokens * PREFILL_WEIGHT,
                                     seats=config.max_num_seqs)
        self.seats = TenantSeats(config.max_num_seqs, config.tenant_share, seats_by_service,
                                 self.service)
        self.class_step = (ClassStep(step_cost, config.max_num_batched_tokens, config.itl_target_ms)
                           if step_cost and config.itl_target_ms and class_step else None)
        self.fair_slack = fair_slack
        self.tenant_preempt = tenant_preempt
        # seq_ids still waiting when the last step was planned (a seat taken for a tenant
        # behind goes to a prompt that waited a step, or sooner if no seat comes back)
        self.waited: frozenset[str] = frozenset()
        self.pace = PrefillPace()  # the ITL target's floor: the paced prefill's deadline
        # seq_id -> steps in a row it sat out, as of the last plan (its StepContents.skipped)
        self.skipped: Mapping[str, int] = {}
        # preemptions by reason (preemption.REASONS), cumulative: the worker's metrics tell a
        # seat taken for a tenant behind from memory pressure
        self.preemptions: Counter[str] = Counter()

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
            self.priorities_seen.add(s.priority)
            if len(self.tenants_seen) < 2:
                self.tenants_seen.add(s.tenant)
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
    def competing(self) -> bool:
        """Has this replica queued requests that a step may yield to each other (layer yield's
        ``auto``): of two priorities or more, or, where it divides seats among tenants
        (``tenant_share`` < 1), of two tenants or more."""
        return len(self.priorities_seen) > 1 or (self.config.tenant_share < 1
                                                 and len(self.tenants_seen) > 1)

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
        work = StepWork(evicted=self.tier.eviction_log())
        copies: list[tuple[int, int]] = []
        preempted = return_seats_over_limit(self)
        seat_for: Optional[SequenceState] = None  # a seat freed for it: admission's first pick
        if self.config.policy == "watermark":
            preempted += preempt_for_higher_class(self, work, now)
            if self.config.tenant_share < 1 and self.tenant_preempt:
                taken = preempt_for_behind_tenant(self, self.waited)
                if not taken:
                    taken, seat_for = preempt_for_share(self, self.waited)
                preempted += taken
        contents, first = self._contents(seat_for)
        budget = step_budget(self.config, self.kv.block_size, self.step_cost, self.running,
                             self.waiting[0] if self.waiting else None, contents.sit_out, now,
                             self.pace)
        if self.config.tenant_share < 1 and self.fair_slack is not None:
            # an over-served tenant's prefill may not make the step long while a less-served
            # one has rows (its seats turn over with the steps)
            budget.fair = fair_bound(self.step_cost, self.running, self.waiting,
                                     self.service.service, self.kv.block_size,
                                     contents.sit_out, slack=self.fair_slack)
        num_preempted = len(preempted)
        scheduled = self._schedule_running(budget, contents.sit_out, preempted, copies, work)
        if len(preempted) > num_preempted:
            first = ()  # the running set and the queue changed since the pick: pick again
        admitted = Pass(Mode.STEP, Held.of(self.running, self.pending_forks), work, now, contents)
        # Without class_step's contents, a tenant's first prompt in the step still keeps the
        # prompts of its class's tenants served strictly more out of it where seats are
        # divided (tenant_share < 1): admitted behind it they would fill the step to the token
        # budget. Lower classes still fill it, as they always did without the ITL target.
        hold = self.class_step is None and self.config.tenant_share < 1
        scheduled += admit_waiting(self, budget, admitted, first, favour_first=hold,
                                   within_class=True, allow=self._not_behind_better(admitted))
        if self.waiting:
            self.pace.admission_stopped(admitted.stopped_by not in (None, Refusal.BUDGET))
        self.waited = frozenset(s.seq_id for s in self.waiting)
        if self.spec.enabled:
            scheduled = add_drafts(self, scheduled, budget.tokens_left, work)
        chunks = tuple(s.chunk(self.kv.block_tables(s.seq.seq_id)) for s in scheduled)
        restores = tuple(work.restores)
        return SchedulerOutput(StepPlan(chunks, tuple(copies), tuple(work.evicted or ()),
                                        self.tier.plan_restores(restores)),
                               tuple(scheduled), tuple(preempted), restores)

    def _schedule_running(self, budget: StepBudget, sit_out: frozenset[str],
                          preempted: list[SequenceState], copies: list[tuple[int, int]],
                          work: StepWork) -> list[ScheduledSeq]:
        """Running sequences, best class first, oldest first (decodes and prefills in
        progress), but those in ``sit_out``; one that cannot grow preempts the newest."""
        scheduled: list[ScheduledSeq] = []
        i = 0
        self.running.sort(key=order_key)
        while i < len(self.running) and budget.has_room:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = 0 if seq.seq_id in sit_out else budget.grant(
                seq.num_computed_tokens, self.blocks.chunk(remaining), reserved=remaining == 1,
                seq=seq)
            if n <= 0:
                i += 1
                continue
            while not self._grow(seq, seq.num_computed_tokens + n, copies, work):
                if self.config.policy == "reserve":
                    raise AssertionError("reserve policy ran out of reserved blocks")
                victim = self.running[-1]
                self.preempt(victim, reason=BLOCKS)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted itself; it is the last one, loop ends
            scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget.take(seq.num_computed_tokens, n, reserved=remaining == 1, seq=seq)
            i += 1
        return scheduled

    def _not_behind_better(self, admitted: Pass) -> Callable[[SequenceState], bool]:
        """Admission's ``allow`` for a whole step: once a prompt is admitted beside running
        rows of a lower class, no prompt of a lower class joins the step: its prefill would
        fill the step to the token budget, and the better prompt's first token waits for all
        of it (under an ITL target class_step keeps it out too; with the class headroom a
        better prompt no longer takes the last free seat that kept it out before)."""
        better: list[int] = []

        def allow(seq: SequenceState) -> bool:
            if any(p < seq.priority for p in better):
                return False
            if any(p > seq.priority and n for p, n in admitted.held.by_class.items()):
                better.append(seq.priority)  # admitted beside a lower class, if at all
            return True

        return allow

    def _contents(self, seat_for: Optional[SequenceState] = None
                  ) -> tuple[StepContents, FirstPick]:
        """The step's contents (:class:`ClassStep`: rows left out, the favoured prefill; none
        without it) and the waiting sequence taken as admission's next pick (``(seq or
        None,)``; ``()`` when none was looked up: no rule, or no free seat). ``seat_for``: the
        sequence a seat was just freed for (:func:`~.preemption.preempt_for_share`), the
        pick whatever the rule."""
        if self.class_step is None:
            return StepContents(), (() if seat_for is None else (seat_for,))
        first: FirstPick = ()
        candidate = seat_for
        held = seats_by_class(self.running, self.pending_forks)
        if seat_for is not None:
            first = (seat_for,)
        elif self.waiting and self.rules.free_seats(self.waiting[0].priority, held) > 0:
            candidate = self.seats.next_waiting(self.waiting, self.pending_forks,
                                                Counter(s.tenant for s in self.running), {})
            first = (candidate,)
        contents = self.class_step.sit_out(self.running, candidate, self.service, self.skipped)
        self.skipped = contents.skipped
        return contents, first

    def _grow(self, seq: SequenceState, num_tokens: int, copies: list[tuple[int, int]],
              work: StepWork) -> bool:
        """Make ``seq``'s tables cover ``num_tokens`` positions; first, if the block its next
        token goes into is shared (a fork's partial prompt block; in each layer group), swap
        in a private copy and append ``(src, dst)`` to ``copies``. Returns False, changing
        nothing, when too few blocks are free."""
        cow = self.blocks.pending_copy(seq)
        new = self.kv.new_blocks(seq.seq_id, num_tokens)
        if new + cow > self.kv.num_free_blocks:
            return False
        if cow:
            copies += self.kv.copy_on_write(seq.seq_id, evicted=work.evicted)
        allocated = self.kv.allocate_slots(seq.seq_id, num_tokens, evicted=work.evicted)
        assert allocated is not None, "free blocks were counted just above"
        return True

    def preempt(self, seq: SequenceState, count: bool = True, reason: str = BLOCKS) -> None:
        """Preempt running ``seq`` by recompute: free its blocks and put it back in FCFS order
        (``count``: as a preemption, under ``reason``, one of :data:`.preemption.REASONS`; a
        failed tier restore's undo is not one)."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.timing.prefill_started = None  # its recompute is a new prefill
        seq.num_computed_tokens = 0
        seq.num_preemptions += count
        if count:
            self.preemptions[reason] += 1
        insert_waiting(self.waiting, seq)  # back at its class and FCFS position

    def undo_restores(self, out: SchedulerOutput) -> None:
        """``out``'s tier restores failed on some rank: its restoring sequences wait again, to
        recompute (call :meth:`schedule` again for the step)."""
        self.tier.undo(out.restores, lambda seq: self.preempt(seq, count=False))

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
            # A sliding group's blocks no token still to compute attends to go back now.
            self.kv.free_out_of_window(seq.seq_id, seq.num_computed_tokens)
            if s.sample and seq.seq_id in self.pending_forks:
                new = fork_siblings(self.kv, seq, self.pending_forks.pop(seq.seq_id))
                self.running += [f.sibling for f in new]
                forks += new
        return forks

    def accept_drafts(self, seq: SequenceState, accepted: int) -> None:
        """``seq``'s last step verified ``accepted`` of its drafts (their tokens are appended
        already): count their positions as computed, register the blocks they filled, and
        give back blocks only rejected drafts were written to (and, in sliding layer groups, the
        blocks the window has now passed)."""
        before = seq.num_computed_tokens
        seq.num_computed_tokens += accepted
        if accepted:
            self.service.charge(seq.tenant, decode_tokens=accepted)
        self.kv.cache_full_blocks(seq.seq_id, seq.block_hashes, seq.num_computed_tokens,
                                  from_token=before)
        self.kv.trim(seq.seq_id, seq.num_tokens)
        # accepted drafts moved the window too
        self.kv.free_out_of_window(seq.seq_id, seq.num_computed_tokens)

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
            insert_waiting(self.waiting, orphan)
        self.tier.forget(seq)
        self.kv.free(seq.seq_id)
        if seq.status is not SeqStatus.FINISHED:
            self.spec.finished(seq)
        seq.status = SeqStatus.FINISHED
