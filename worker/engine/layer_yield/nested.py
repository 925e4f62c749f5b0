"""Layer-level yield: the scheduler's side of a step that pauses between layers for a higher class
(or a less-served tenant).

With atomic steps, an interactive request arriving beside a batch flood waits for the whole
batch step in flight (its decode rows and a prefill chunk, often longer than its own step)
before its own step: its TTFT tail stays well above unloaded however the batch steps are
sized (docs/slo.md). The lever: between decoder layers, when a request that the step in flight
yields to (:func:`yields_to`) has arrived, pause the step after the current layer (its hidden
states kept, the KV of the layers done already in its own slots), run a **nested step**
(:func:`nested_step`), then resume the paused step from the next layer. The residual wait is
about one layer instead of a whole step.

This module is the scheduler's rule, driven by the virtual-clock sim (``bench class_sim
--layer-yield``) and by the engine through its one seam (:mod:`.forward`, with
``SchedulerConfig.layer_yield``, default ``auto``: docs/slo.md, "Layer-level yield").
The rule, so that the paused step is never disturbed:

* it yields to a class when it holds a row of a strictly lower class, no row of a better
  one, and no same-class row that has not streamed yet (:func:`yields_to`); where the
  replica divides seats among tenants (``tenant_share`` < 1) also to a same-class prompt of
  a tenant served less than the tenants of the rows it overtakes (a light tenant's prompt
  beside a flood's prefill steps; docs/slo.md, "Fairness without the ITL target");
* the nested step admits **waiting** sequences of such a class as a whole step admits them
  (:func:`~kvfleet.worker.engine.scheduling.admission.try_admit`, ``NESTED`` mode: class,
  then the least-served tenant; tenant share, batch share, the step's contents), each with a
  first prefill chunk within the step's token (and, under an ITL target, time) budget; never
  a running sequence, so never a row of the paused step;
* it takes only **free** blocks (nothing is preempted while the paused step holds its
  slots), under the replica's block policy (watermark or reserve) as admission does;
* a seat: a free one, or, under ``watermark``, one **borrowed** from a lower-class running
  sequence that the class rules would let it preempt (:meth:`PriorityRules.victims`); the
  next :meth:`Scheduler.schedule` preempts such victims while the running set is over
  ``max_num_seqs`` (:func:`~kvfleet.worker.engine.scheduling.preemption.
  return_seats_over_limit`), unless sequences finished first and gave the seats back, so
  seats end where class preemption would have put them. With ``tenant_share`` < 1, **one**
  seat more while a same-class tenant served more runs: no victim is preempted for it, it
  comes back at the next finish (the running set over ``max_num_seqs`` admits nothing);
* no n > 1 request (its siblings fork at the leader's first sample): it waits for the next
  whole step;
* beside a host KV tier it is planned as a whole step is: the cached blocks its allocations
  evict are listed for write-back (``plan.block_saves``) and its tier hits for restore
  (``plan.block_restores``); the engine moves them before the nested forward, as before any
  step's. Both touch only blocks no running sequence holds (evicted blocks are unreferenced,
  restore targets fresh), so never a slot of the paused step, whose own moves ran before it.

A pausable executor runs it: in process, or over tensor-parallel ranks, which all pause at
the layer rank 0 decides and run the nested step's plan from the same broadcast as any
step's.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Mapping, Optional

from kvfleet.worker.engine.scheduling.admission import Held, Mode, Pass, StepWork, admit_waiting
from kvfleet.worker.engine.scheduling.output import SchedulerOutput
from kvfleet.worker.engine.scheduling.step_budget import step_budget
from kvfleet.worker.engine.scheduling.tenant_service import served_more
from kvfleet.worker.engine.step_plan import StepPlan

if TYPE_CHECKING:  # only for annotations
    from kvfleet.worker.engine.request import SequenceState
    from kvfleet.worker.engine.scheduling.scheduler import Scheduler


def yields_to(out: SchedulerOutput, priority: int, tenant: Optional[str] = None,
              service: Optional[Mapping[str, float]] = None) -> bool:
    """May step ``out`` (in flight) pause for a nested step of class ``priority``? When it
    holds a row it outranks (something to yield), no row of a better class, and no prefill
    row (not streamed yet) of the same class that it does not outrank: a same-class decode
    row loses one token gap to the nested prefill, as it would beside that prefill's own step;
    an older same-class prompt is never overtaken. Without ``tenant`` it outranks rows of a
    strictly lower class; with ``tenant`` and ``service`` (weighted tokens served per tenant,
    :class:`~kvfleet.worker.engine.scheduling.tenant_service.TenantService`) also same-class
    rows of *another* tenant served strictly more (fairness: a less-served tenant's prompt
    overtakes a flood's prefill, as class_step's favoured prefill does; equally served
    tenants never pause each other)."""
    lower = False
    for s in out.scheduled:
        p = s.seq.priority
        if p < priority:
            return False
        if p > priority or (tenant is not None and service is not None
                            and served_more(service, s.seq.tenant, tenant)):
            lower = True
        elif not s.seq.output_token_ids:
            return False
    return lower


def yields_to_seq(sched: Scheduler, out: SchedulerOutput, seq: SequenceState) -> bool:
    """:func:`yields_to` for waiting ``seq``: by class, and by its tenant's service too where
    the replica divides seats among tenants (``tenant_share`` < 1)."""
    if sched.config.tenant_share < 1:
        return yields_to(out, seq.priority, seq.tenant, sched.service.service)
    return yields_to(out, seq.priority)


def may_yield(sched: Scheduler, paused: SchedulerOutput) -> bool:
    """Could a nested step run now beside ``paused`` (the step in flight): is the sequence
    admission would take first one that ``paused`` yields to (:func:`yields_to_seq`)? The
    head of the waiting queue (its best class, oldest); with ``tenant_share`` < 1, the
    oldest of the least-served tenant that may take a seat (a scan of the queue)."""
    if not sched.waiting:
        return False
    if sched.config.tenant_share >= 1:
        return yields_to(paused, sched.waiting[0].priority)
    nxt = sched.seats.next_waiting(sched.waiting, sched.pending_forks,
                                   Counter(s.tenant for s in sched.running), {})
    return nxt is not None and yields_to_seq(sched, paused, nxt)


def nested_step(sched: Scheduler, paused: SchedulerOutput, now: float) -> SchedulerOutput:
    """Plan the step that runs while ``paused`` (planned, not yet done) waits between two
    layers: first prefill chunks of waiting sequences of a class ``paused`` yields to
    (:func:`yields_to`), admitted as a whole step admits (:func:`~kvfleet.worker.engine.
    scheduling.admission.try_admit`, ``NESTED`` mode) on free blocks and free or borrowable
    seats (module docstring). They are running after this call, as after
    :meth:`Scheduler.schedule`.

    Returns:
        The nested step (empty ``scheduled`` when nothing may run: then nothing changed),
        with the write-backs and tier restores its admissions made in its plan. Move those
        (:func:`~kvfleet.worker.kv_tier.moves.move_blocks`) before its forward, and call
        :meth:`Scheduler.on_step_done` with it after, independently of ``paused``'s.
    """
    if not may_yield(sched, paused):
        return SchedulerOutput(StepPlan(()), ())
    in_paused = {s.seq.seq_id for s in paused.scheduled}
    config, kv = sched.config, sched.kv
    head = sched.waiting[0] if sched.waiting else None
    budget = step_budget(config, kv.block_size, sched.step_cost, (), head, frozenset(), now)

    def borrowable(seq: SequenceState) -> int:
        """Seats class preemption could take for ``seq``; with ``tenant_share`` < 1 one more
        while a same-class tenant served more runs (it comes back when a sequence finishes:
        nothing is preempted for it, and nothing admitted while the running set is over)."""
        if config.policy != "watermark":
            return 0
        n = len(sched.rules.victims(seq, sched.running))
        if config.tenant_share < 1:
            n += any(r.priority == seq.priority and sched.service.served_more(r.tenant, seq.tenant)
                     for r in sched.running)
        return n

    def allow(seq: SequenceState) -> bool:
        assert seq.seq_id not in in_paused, "a waiting sequence cannot be in the step in flight"
        return yields_to_seq(sched, paused, seq)  # sorted by class: nothing behind it either

    work = StepWork(evicted=sched.tier.eviction_log())
    p = Pass(Mode.NESTED, Held.of(sched.running, sched.pending_forks), work, now,
             borrowable=borrowable)
    scheduled = admit_waiting(sched, budget, p, allow=allow,
                              favour_first=sched.class_step is not None)
    chunks = tuple(s.chunk(kv.block_tables(s.seq.seq_id)) for s in scheduled)
    restores = tuple(work.restores)
    plan = StepPlan(chunks, block_saves=tuple(work.evicted or ()),
                    block_restores=sched.tier.plan_restores(restores))
    return SchedulerOutput(plan, tuple(scheduled), restores=restores)
