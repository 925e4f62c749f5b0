"""The engine's block moves before a step's forward: write back evicted blocks, restore hits.

If any rank fails to restore, the restoring sequences go back to wait and the step is planned
again without them (they recompute); the first plan's copy-on-writes are kept, since its
block tables already changed. A failure of the transfer call itself (a tensor-parallel group
that died) is left to the forward, which reports it as it reports any rank failure.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from kvfleet.worker.executor.base import Executor

log = logging.getLogger(__name__)
_MAX_REPLANS = 3


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
    itself, or a new plan without the restores that failed."""
    copies = out.plan.block_copies
    for _ in range(_MAX_REPLANS):
        if not (out.plan.block_saves or out.plan.block_restores):
            break
        if _transfer(executor, out):
            scheduler.tier.restored(out.restores)
            break
        if not out.plan.block_restores:
            break  # only write-backs failed: they are dropped, the step runs as planned
        log.warning("kv tier restore of %d blocks failed: recomputing",
                    len(out.plan.block_restores))
        scheduler.undo_restores(out)
        out = scheduler.schedule()
        copies += out.plan.block_copies
        out = replace(out, plan=replace(out.plan, block_copies=copies))
    return out
