"""The one admission routine (``try_admit``) in its three passes: a nested step admits as a
whole step does (its order, the batch share, the step's favoured prefill), and class
preemption counts a sequence's host-tier hits as admission will."""

from __future__ import annotations

import numpy as np

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.engine.layer_yield.nested import nested_step
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.step_cost.model import CostModel
from tests.unit.worker.scheduler_harness import BS, make_scheduler, new_seq, run_step

LOWEST = BATCH + 1  # a class below batch: a step of its rows yields to batch


def rows_in_flight(s: Scheduler, n: int, priority: int = LOWEST):
    """``n`` streamed rows of ``priority``, then a step of them planned (in flight)."""
    rows = [new_seq(prompt_len=8, max_tokens=50, priority=priority) for _ in range(n)]
    s.add(rows)
    run_step(s)
    return rows, s.schedule()


def test_a_nested_step_keeps_the_batch_share() -> None:
    # 4 seats, the batch band (priority >= batch) 2 of them: a lowest-class row runs, so one
    # batch prompt may start nested beside its paused step, not two (before: both).
    s = make_scheduler(64, max_num_seqs=4, batch_share=0.5)
    _, paused = rows_in_flight(s, 1)
    b1, b2 = (new_seq(prompt_len=8, priority=BATCH) for _ in range(2))
    s.add([b1, b2])
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [b1] and b2.status is SeqStatus.WAITING


def test_a_nested_step_takes_the_least_served_tenant_first() -> None:
    s = make_scheduler(64, max_num_seqs=8)
    _, paused = rows_in_flight(s, 2, BATCH)
    early_a = new_seq(prompt_len=8, priority=INTERACTIVE, tenant="a")
    late_b = new_seq(prompt_len=8, priority=INTERACTIVE, tenant="b")
    s.add([early_a])
    s.add([late_b])
    s.service.charge("a", prefill_tokens=1000)  # a has been served more than b
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [late_b, early_a]  # before: FCFS, a first


def test_a_nested_step_under_an_itl_target_holds_back_what_its_first_prefill_outranks() -> None:
    cost = CostModel(0.016, 0.000625, 0.0044, "fake: the benches' scaled model")
    s = Scheduler(SchedulerConfig(max_num_seqs=8, itl_target_ms=150.0),
                  KVCacheManager(64, BS), cost)
    rows = [new_seq(prompt_len=8, max_tokens=50, priority=BATCH) for _ in range(2)]
    s.add(rows)
    run_step(s)
    paused = s.schedule()
    b = new_seq(prompt_len=8, priority=INTERACTIVE, tenant="b")
    a = new_seq(prompt_len=8, priority=INTERACTIVE, tenant="a")
    s.add([b])
    s.add([a])
    s.service.charge("a", prefill_tokens=1000)  # a served more: b's prefill outranks a's
    nested = nested_step(s, paused, 0.0)
    assert [x.seq for x in nested.scheduled] == [b]  # before: both
    assert a.status is SeqStatus.WAITING


def _tier_prefix(kv: KVCacheManager, seq: SequenceState, blocks: int) -> TierLookup:
    """A host tier holding the first ``blocks`` blocks of ``seq``'s prompt."""
    store = HostTierStore(1 << 20)
    store.put(0, seq.block_hashes[:blocks], np.zeros((blocks, 8), dtype=np.uint8))
    return TierLookup(store)


def test_class_preemption_counts_host_tier_hits_as_admission_does() -> None:
    # 2 seats held by streamed batch rows; two interactive prompts of 16 tokens arrive, the
    # first with 3 of its 4 blocks in the host tier. The step's 16 tokens cover both first
    # chunks (4 + 12 tokens) once the tier hits are counted: both take a seat in this step
    # (before: the first claimed all 16 tokens, and the second waited a step for a seat).
    kv = KVCacheManager(64, BS)
    first = new_seq(prompt_len=16, priority=INTERACTIVE)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, class_headroom=0), kv,
                  tier=_tier_prefix(kv, first, 3))
    batch = [new_seq(prompt_len=4, max_tokens=50, priority=BATCH) for _ in range(2)]
    s.add(batch)
    run_step(s)
    second = new_seq(prompt_len=12, priority=INTERACTIVE)
    s.add([first, second])
    out = s.schedule()
    assert sorted(x.seq_id for x in out.preempted) == sorted(x.seq_id for x in batch)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(first, 4), (second, 12)]
    assert [r.seq for r in out.restores] == [first] and len(out.plan.block_restores) == 3
