"""A restore that misses (the tier evicted a block since the lookup) sends only its sequences
back to recompute: the step runs the rest of the plan it already made (schedule() is not run
again: it is not idempotent), and the tier stays on for every other sequence."""

from __future__ import annotations

import numpy as np

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.worker.engine.request import SeqStatus
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.moves import move_blocks
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.scheduler_harness import BS, new_seq, run_step


class _Counting(Scheduler):
    calls = 0

    def schedule(self, now=None):
        self.calls += 1
        return super().schedule(now)


class _MissingExecutor:
    """Every restore misses on some rank; records the moves it was asked."""

    def __init__(self) -> None:
        self.moves: list = []

    def transfer_blocks(self, saves, restores) -> bool:
        self.moves.append((tuple(saves), tuple(restores)))
        return not restores


def test_a_restore_miss_recomputes_its_sequence_only_and_plans_once() -> None:
    store = HostTierStore(1 << 20)
    lookup = TierLookup(store)
    s = _Counting(SchedulerConfig(), KVCacheManager(32, BS), tier=lookup)
    decoding = new_seq(prompt_len=3, max_tokens=20)
    s.add([decoding])
    run_step(s)
    missed, other = new_seq(prompt_len=13), new_seq(prompt_len=13)
    for seq in (missed, other):
        store.put(0, seq.block_hashes[:3], np.zeros((3, 8), dtype=np.uint8))
    s.add([missed])
    s.calls = 0
    out = s.schedule()
    assert [r.seq for r in out.restores] == [missed]
    ex = _MissingExecutor()
    ran = move_blocks(ex, s, out)
    assert s.calls == 1  # the plan was not made again
    assert [x.seq for x in ran.scheduled] == [decoding]
    assert [c.seq_id for c in ran.plan.chunks] == [decoding.seq_id]
    assert ran.restores == () and ran.plan.block_restores == ()
    assert missed.status is SeqStatus.WAITING and missed.tier_skip
    assert len(ex.moves) == 1
    s.kv.check_invariants()
    s.on_step_done(ran)
    # One miss is no outage: the next sequence still restores from the tier.
    s.add([other])
    out = run_step(s)
    assert other in [r.seq for r in out.restores]
