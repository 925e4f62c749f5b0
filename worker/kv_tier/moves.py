"""The engine's block moves before a step's forward: write back evicted blocks, restore hits.

If any rank fails to restore (a block the tier evicted since the lookup, a tier that did not
answer), the restoring sequences go back to wait and recompute, and the step runs the rest of
its plan without them: the plan is filtered, never made again (planning is not idempotent:
it preempts, charges and counts). The first plan's copy-on-writes and write-backs stand. A
failure of the transfer call itself (a tensor-parallel group that died) is left to the
forward, which reports it as it reports any rank failure.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from kvfleet.worker.executor.base import Executor

log = logging.getLogger(__name__)


def _transfer(executor: Executor, out: SchedulerOutput) -> bool | None:
    """True: every rank restored; False: some restore failed (the saves were snapshotted);
    None: the call itself failed (nothing is known to have moved)."""
    try:
        return executor.transfer_blocks(out.plan.block_saves, out.plan.block_restores)
    except Exception:  # the forward that follows fails the same way and reports it
        log.exception("kv tier transfer failed")
        return None


def move_blocks(executor: Executor, scheduler: Scheduler, out: SchedulerOutput
                ) -> SchedulerOutput:
    """Run ``out``'s saves and restores on every rank. Returns the plan to execute: ``out``
    itself, or ``out`` without the sequences whose restores failed (they wait again)."""
    if not (out.plan.block_saves or out.plan.block_restores):
        return out
    if _transfer(executor, out):
        scheduler.tier.restored(out.restores)
        return out
    if not out.plan.block_restores:
        return out  # only write-backs failed: they are dropped, the step runs as planned
    log.info("kv tier restore of %d blocks missed: recomputing them",
             len(out.plan.block_restores))
    gone = {r.seq.seq_id for r in out.restores}
    scheduler.undo_restores(out)
    keep = [i for i, s in enumerate(out.scheduled) if s.seq.seq_id not in gone]
    plan = replace(out.plan, chunks=tuple(out.plan.chunks[i] for i in keep), block_restores=())
    return replace(out, plan=plan, scheduled=tuple(out.scheduled[i] for i in keep), restores=())
