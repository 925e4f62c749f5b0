"""Continuous-batching scheduler: decides each step's plan; the model runner executes it.

Each step: running sequences first (decodes, and prefills still catching up), then waiting
sequences (FCFS, fair among tenants: see below) with chunked prefill filling the remaining token budget
(``max_num_batched_tokens``) up to ``max_num_seqs``. With ``itl_target_ms`` set, the step's
predicted time is budgeted too (:mod:`~kvfleet.worker.engine.step_budget`), and a higher class's
or the least-served tenant's prefill runs without the others' rows (:mod:`.class_step`). Admission follows
the replica's policy (docs/design.md §3):

* ``watermark`` (default): admit when the uncached prompt fits and a free-block watermark
  stays free; when a running sequence cannot grow, preempt the newest running sequence by
  recompute (its blocks are freed; it re-enters the waiting queue at its FCFS position and
  later recomputes prompt + output, reusing whatever prefix blocks are still cached).
* ``reserve``: admit only when blocks for ``prompt + max_tokens`` are free; never preempts.

Among tenants the waiting queue is fair by service, not by count: the next sequence admitted
is the oldest waiting one of the tenant that has been served least — weighted prefill tokens
computed (prefix-cache hits are free) plus decode tokens (:mod:`.tenant_service`, a VTC-style
counter charged after every step) — so a tenant that floods the queue, or sends long prompts,
does not hold another tenant's requests behind its own. With ``tenant_share`` below 1 a tenant
also runs at most that share of ``max_num_seqs`` sequences (one with nothing running may always
start one request); a tenant at its share is passed over for the next — unless
(``seats_by_service``, the default) a waiting tenant has been served more than it: then it
may run past its share, so that seats, and with them each tenant's share of the work, follow
service rather than a fixed count, while a tenant ahead that waits for nothing keeps the rest
of its share free for its next arrival.

Priority classes (``kvfleet.worker.engine.priority_queue``): the waiting queue and the running
set are ordered by class first (lower ``priority`` first), FCFS within a class, and the tenant
rule above applies within the best waiting class. Before a step, a waiting sequence that finds
no seat or too few blocks may preempt running sequences of a lower class (by recompute: those
that have not streamed a token yet, all with ``preempt_streaming``); ``batch_share`` caps the
seats the ``batch`` band may hold.

Parallel sampling (``n > 1``): only sample 0 (the *leader*) is queued; its siblings wait
beside it. When the leader's prompt is fully computed they fork its block table (one more
reference per block, no KV computed twice) and join the running set, each sampling its first
token from the leader's logits. The prompt's partially filled last block is then shared:
before a sequence writes into a shared block, the scheduler gives it a private copy
(``StepPlan.block_copies``, copy-on-write), so no sibling ever writes a block another reads.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, Optional

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.allocator.units import cdiv
from kvfleet.errors import ResourceExhausted
from kvfleet.priority import BATCH
from kvfleet.worker.engine.class_step import ClassStep
from kvfleet.worker.engine.hit_counts import HitCounts
from kvfleet.worker.engine.priority_queue import (
    PriorityRules,
    batch_held,
    head_class,
    insert_waiting,
    order_key,
)
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.step_budget import StepBudget, floor_tokens
from kvfleet.worker.engine.step_cost import StepCostModel
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.engine.tenant_service import TenantService
from kvfleet.worker.engine.tier_admission import TierAdmission
from kvfleet.worker.kv_tier.lookup import TierLookup

POLICIES = ("watermark", "reserve")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits of one replica.

    ``watermark`` is the fraction of all blocks kept free when admitting new work under the
    ``watermark`` policy (so running sequences can grow without immediate preemption).
    ``max_waiting``: sequences that may wait beside a full running set; the replica holds at
    most ``max_sequences`` = ``max_num_seqs + max_waiting`` unfinished sequences in all (the
    same bound the worker's arrival count applies, so the engine never refuses one it let in).
    ``itl_target_ms``: a step's predicted forward time (ms) that prefill chunks may fill up to,
    beside the token budget (None: the token budget alone).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    policy: str = "watermark"
    watermark: float = 0.01
    # Fraction of max_sequences (waiting + running, refused on arrival past it) and of
    # max_num_seqs (running) one tenant may hold on this replica (1.0: no per-tenant cap).
    tenant_share: float = 1.0
    itl_target_ms: Optional[float] = None
    # Priority classes: the fraction of max_num_seqs the batch band may run (1.0: no cap), and
    # whether a higher class may preempt lower-class sequences that have streamed tokens.
    batch_share: float = 1.0
    preempt_streaming: bool = False
    # Under an ITL target: a favoured prefill's step leaves out outranked rows (class_step.py).
    class_step: bool = True
    # With tenant_share < 1: a tenant may run past its share of seats while a waiting tenant
    # has been served more than it (seats then follow service; False: a fixed cap).
    seats_by_service: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_waiting < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0, max_waiting >= 0")
        if not 0 < self.tenant_share <= 1:
            raise ValueError(f"tenant_share must be in (0, 1], got {self.tenant_share}")
        if self.itl_target_ms is not None and not 0 < self.itl_target_ms < float("inf"):
            raise ValueError(f"itl_target_ms must be > 0, got {self.itl_target_ms}")
        PriorityRules(self.max_num_seqs, self.batch_share, self.preempt_streaming)  # checks

    @property
    def max_sequences(self) -> int:
        """Sequences the replica holds at most (running + waiting): its admission limit."""
        return self.max_num_seqs + self.max_waiting


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's part of a step. ``sample`` is true when the chunk reaches the sequence's
    last known token, so its logits give the next token."""

    seq: SequenceState
    num_new_tokens: int
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    plan: StepPlan
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[SequenceState, ...] = ()


@dataclass(frozen=True)
class Fork:
    """A sibling that joined the running set after ``leader``'s prompt was computed; it samples
    its first token from the leader's logits of that step."""

    leader: SequenceState
    sibling: SequenceState


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
        self._watermark_blocks = int(config.watermark * kv.num_total_blocks)
        # Running slots one tenant may hold (tenant_share < 1 keeps the rest for the others,
        # so a newly arrived tenant starts at the next step, not when a flood's requests end).
        self._tenant_seats = max(1, int(config.max_num_seqs * config.tenant_share))
        self.rules = PriorityRules(config.max_num_seqs, config.batch_share,
                                   config.preempt_streaming)
        self.service = TenantService()  # per-tenant service: who is admitted next
        self.class_step = (ClassStep(step_cost, config.max_num_batched_tokens, config.itl_target_ms)
                           if step_cost and config.itl_target_ms and config.class_step else None)

    # ---- admission -------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.kv.block_size)

    def group_blocks(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """Blocks ``n`` samples of one request hold at most, siblings sharing the full prompt
        blocks (each sibling owns the rest, its copy of the partial prompt block included)."""
        per_seq = self.blocks_for(num_prompt_tokens + max_tokens)
        return per_seq + (n - 1) * (per_seq - num_prompt_tokens // self.kv.block_size)

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
        group = n if self.config.policy == "reserve" else 1
        need = self.group_blocks(num_prompt_tokens, max_tokens, group)
        if need > self.kv.num_total_blocks:
            raise ResourceExhausted(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens})"
                f"{f' for n={n} samples' if group > 1 else ''} needs {need} KV blocks of "
                f"{self.kv.block_size} tokens; this replica has {self.kv.num_total_blocks} in total"
            )

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
        preempted: list[SequenceState] = []
        copies: list[tuple[int, int]] = []
        if self.config.policy == "watermark":
            self._preempt_for_higher_class(preempted)
        sit_out = self._sit_out()
        budget = self._budget(now, sit_out)

        # 1. Running sequences, best class first, oldest first (decodes and prefills in progress).
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
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted itself; it is the last one, loop ends
            scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget.take(seq.num_computed_tokens, n, reserved=remaining == 1)
            i += 1

        # 2. Waiting sequences by class, the least-served tenant first within it (FCFS within
        # one); stop at the first that does not fit (no starvation).
        seats = self._seats()
        batch_seats = batch_held(self.running, self.pending_forks)
        running_by_tenant = Counter(s.tenant for s in self.running)
        planned: dict[str, float] = {}  # service admitted this step, charged after it
        while self.waiting and budget.has_room:
            if (picked := self._next_waiting(running_by_tenant, planned)) is None:
                break  # every waiting tenant holds its share of the running slots
            seq = picked
            if self.class_step and self.class_step.holds_back(seq, self.service):
                break  # a favoured prefill runs in a short step (class_step.py)
            group = 1 + len(self.pending_forks.get(seq.seq_id, ()))
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
            if not self._admissible(seq, computed, num_cached + n):
                break
            if self.kv.allocate_slots(seq.seq_id, num_cached + n, computed) is None:
                break
            if self.tier:
                self.tier.admitted(seq, len(computed), hits)
            self.waiting.remove(seq)
            running_by_tenant[seq.tenant] += group
            batch_seats += group if seq.priority >= BATCH else 0
            seq.status = SeqStatus.RUNNING
            seq.timing.prefill_started = now
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
                self.hits.admitted(seq.num_tokens, len(computed) * self.kv.block_size,
                                   len(hits) * self.kv.block_size)
            self.running.append(seq)
            seats += group
            scheduled.append(ScheduledSeq(seq, n, num_cached + n == seq.num_tokens))
            budget.take(num_cached, n)
            planned[seq.tenant] = planned.get(seq.tenant, 0.0) + self.service.cost(prefill_tokens=n)

        chunks = tuple(
            SeqChunk(
                seq_id=s.seq.seq_id,
                token_ids=s.seq.token_slice(s.seq.num_computed_tokens,
                                            s.seq.num_computed_tokens + s.num_new_tokens),
                num_computed_tokens=s.seq.num_computed_tokens,
                block_table=tuple(self.kv.block_table(s.seq.seq_id)),
                adapter_slot=s.seq.adapter_slot,
            )
            for s in scheduled
        )
        saves, restores = ((tuple(self.kv.take_evictions()), self.tier.take_restores())
                           if self.tier else ((), ()))
        return SchedulerOutput(StepPlan(chunks, tuple(copies), saves, restores),
                               tuple(scheduled), tuple(preempted))

    def _budget(self, now: float, sit_out: frozenset[str]) -> StepBudget:
        """This step's allowance; under an ITL target the running decode rows (but those
        in ``sit_out``) are counted first and the floor follows the oldest prefill in
        progress (:meth:`prefill_wait`)."""
        target_ms = self.config.itl_target_ms
        if target_ms is None:
            return StepBudget(self.config.max_num_batched_tokens, self.kv.block_size)
        target_s = target_ms / 1e3
        floor = floor_tokens(self.kv.block_size, target_s, self.prefill_wait(now))
        budget = StepBudget(self.config.max_num_batched_tokens, self.kv.block_size,
                            self.step_cost, target_s, floor)
        budget.reserve_decodes(s.num_computed_tokens for s in self.running
                               if s.num_tokens - s.num_computed_tokens == 1
                               and s.seq_id not in sit_out)
        return budget

    def _sit_out(self) -> frozenset[str]:
        """Running sequences this step leaves out (:class:`ClassStep`; none without it)."""
        if self.class_step is None:
            return frozenset()
        free = self._seats() < self.config.max_num_seqs
        nxt = self._next_waiting(Counter(s.tenant for s in self.running), {}) if free else None
        return self.class_step.sit_out(self.running, nxt, self.service)

    def prefill_wait(self, now: float) -> Optional[float]:
        """Seconds since the oldest prefill still in progress was admitted (0 when none is
        but a sequence waits; None when no prefill is pending). Counted from admission, not
        arrival: a queue waiting for seats must not grow the floor, or the floor outgrows
        the step and the target stops acting."""
        started = [now if s.timing.prefill_started is None else s.timing.prefill_started
                   for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        if started:
            return max(0.0, now - min(started))
        return 0.0 if self.waiting else None

    def _next_waiting(self, running_by_tenant: Counter, planned: dict[str, float]
                      ) -> Optional[SequenceState]:
        """Of the best waiting class, the oldest waiting sequence of its least-served tenant
        (service + ``planned`` this step) among those below their share of running slots;
        None when every such tenant holds its share."""
        waiting = {s.tenant for s in head_class(self.waiting)}
        oldest: dict[str, SequenceState] = {}
        for s in head_class(self.waiting):  # arrival order: each tenant's first is its oldest
            if s.tenant not in oldest:
                group = 1 + len(self.pending_forks.get(s.seq_id, ()))
                if self._may_take_seat(s.tenant, running_by_tenant[s.tenant], group, waiting):
                    oldest[s.tenant] = s
        # Ties (a tenant just back from idle starts at the others' minimum) go to the tenant
        # running fewer sequences, then to the oldest waiting (sorted is stable).
        tenant = self.service.pick(sorted(oldest, key=running_by_tenant.__getitem__), planned)
        return None if tenant is None else oldest[tenant]

    def _may_take_seat(self, tenant: str, held: int, group: int, waiting: Iterable[str]
                       ) -> bool:
        """May ``tenant``, holding ``held`` running seats, take ``group`` more? Within its
        share (one with none may always start), or past it (``seats_by_service``) while one
        of the tenants with sequences ``waiting`` has been served more: seats are then lent
        by service, and a tenant ahead that waits for none keeps the rest of its share free
        for its next arrival (docs/slo.md, "Seats by service")."""
        return (not held or held + group <= self._tenant_seats
                or (self.config.seats_by_service
                    and self.service.behind(tenant, (t for t in waiting if t != tenant))))

    def _seats(self) -> int:
        """Running seats taken: a running leader's unforked siblings hold theirs too."""
        return len(self.running) + sum(len(self.pending_forks.get(s.seq_id, ()))
                                       for s in self.running)

    def _preempt_for_higher_class(self, preempted: list[SequenceState]) -> None:
        """Let waiting sequences, best class first (queue order), each take a seat and blocks
        for its first chunk from running sequences of a lower class
        (:meth:`PriorityRules.victims`), preempting them one at a time; appends each victim
        to ``preempted``. Stops at the first that finds no victim, or once the first chunks
        made room for fill the step's token budget: a burst of higher-class arrivals gets
        its seats in one step, not one a step."""
        claimed_seats = claimed_blocks = tokens = 0
        claimed_by_tenant: Counter = Counter()
        waiting = {s.tenant for s in head_class(self.waiting)}
        for seq in list(self.waiting):
            if tokens >= self.config.max_num_batched_tokens:
                return
            group = 1 + len(self.pending_forks.get(seq.seq_id, ()))
            if self.config.tenant_share < 1:  # its tenant's share, not the class, may hold it back
                victims = self.rules.victims(seq, self.running)
                held = claimed_by_tenant[seq.tenant] + sum(
                    1 for s in self.running if s.tenant == seq.tenant and s not in victims)
                if not self._may_take_seat(seq.tenant, held, group, waiting):
                    return
            while True:
                computed = self.kv.get_computed_blocks(seq.block_hashes, seq.num_tokens)
                num_cached = len(computed) * self.kv.block_size
                chunk = min(seq.num_tokens - num_cached, self.config.max_num_batched_tokens)
                if (self._seats() + claimed_seats + group <= self.config.max_num_seqs
                        and self._admissible(seq, computed, num_cached + chunk, claimed_blocks)):
                    break
                victims = self.rules.victims(seq, self.running)
                if not victims:
                    return
                self._preempt(victims[0])
                preempted.append(victims[0])
            claimed_seats += group
            claimed_by_tenant[seq.tenant] += group
            claimed_blocks += (self.blocks_for(num_cached + chunk) - len(computed)
                               + sum(1 for b in computed if self.kv.ref_count(b) == 0))
            tokens += chunk

    def _grow(self, seq: SequenceState, num_tokens: int, copies: list[tuple[int, int]]) -> bool:
        """Make ``seq``'s table cover ``num_tokens`` positions; first, if the block its next
        token goes into is shared (a fork's partial prompt block), swap in a private copy and
        append ``(src, dst)`` to ``copies``. Returns False, changing nothing, when too few
        blocks are free."""
        cow = self._pending_copy(seq)
        new = self.blocks_for(num_tokens) - self.kv.num_blocks(seq.seq_id)
        if new + cow > self.kv.num_free_blocks:
            return False
        if cow and (copy := self.kv.copy_on_write(seq.seq_id)) is not None:
            copies.append(copy)
        allocated = self.kv.allocate_slots(seq.seq_id, num_tokens)
        assert allocated is not None, "free blocks were counted just above"
        return True

    def _pending_copy(self, seq: SequenceState) -> int:
        """1 if ``seq``'s next token lands in a partially filled block it shares, else 0."""
        if seq.num_computed_tokens % self.kv.block_size == 0:
            return 0  # the next token starts a new block
        table = self.kv.block_table(seq.seq_id)
        return int(bool(table) and self.kv.ref_count(table[-1]) > 1)

    def _admissible(self, seq: SequenceState, computed: list[int], num_tokens: int,
                    claimed_blocks: int = 0) -> bool:
        """Would admitting ``seq`` (computing up to ``num_tokens``) respect the policy, with
        ``claimed_blocks`` free blocks already promised to others (watermark policy)?

        Reused cached blocks that no live request references count as free (they are
        evictable), so taking them uses up free blocks just like allocating new ones.
        """
        unreferenced = sum(1 for b in computed if self.kv.ref_count(b) == 0)
        if self.config.policy == "reserve":
            # Prompt + max_tokens for this one (and its siblings), plus growth already
            # promised to the running ones.
            siblings = len(self.pending_forks.get(seq.seq_id, ()))
            need = (self.group_blocks(seq.num_prompt_tokens, seq.params.max_tokens, 1 + siblings)
                    - len(computed) + unreferenced)
            return need + self._outstanding_reservations() <= self.kv.num_free_blocks
        need = self.blocks_for(num_tokens) - len(computed) + unreferenced
        # With nothing running nothing needs room to grow: the watermark must not keep a
        # request that fits out of an idle replica forever.
        watermark = self._watermark_blocks if self.running else 0
        return need + watermark + claimed_blocks <= self.kv.num_free_blocks

    def _outstanding_reservations(self) -> int:
        """Blocks promised to running sequences (and their unforked siblings) under
        ``reserve`` but not yet allocated, pending copy-on-writes included."""
        total = 0
        for s in self.running:
            total += max(0, self.blocks_for(s.max_total_tokens) - self.kv.num_blocks(s.seq_id))
            total += self._pending_copy(s)
            for sib in self.pending_forks.get(s.seq_id, ()):
                total += (self.blocks_for(sib.max_total_tokens)
                          - sib.num_prompt_tokens // self.kv.block_size)
        return total

    def _preempt(self, seq: SequenceState, count: bool = True) -> None:
        """Preempt by recompute: free its blocks and put it back in FCFS order (``count``:
        as a preemption; a failed tier restore's undo is not one)."""
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
            self.tier.undo(lambda seq: self._preempt(seq, count=False))

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
                forks += self._fork(seq)
        return forks

    def _fork(self, leader: SequenceState) -> list[Fork]:
        forks = []
        for sib in self.pending_forks.pop(leader.seq_id):
            self.kv.fork(leader.seq_id, sib.seq_id)
            sib.status = SeqStatus.RUNNING
            sib.num_computed_tokens = leader.num_computed_tokens
            sib.num_cached_tokens = leader.num_cached_tokens
            self.running.append(sib)
            forks.append(Fork(leader, sib))
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
            held = False
            for leader_id, siblings in list(self.pending_forks.items()):
                if seq in siblings:
                    held = True
                    siblings.remove(seq)
                    if not siblings:
                        del self.pending_forks[leader_id]
        if held:
            self.service.leave(seq.tenant)
        for orphan in reversed(self.pending_forks.pop(seq.seq_id, [])):
            self._requeue(orphan)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
