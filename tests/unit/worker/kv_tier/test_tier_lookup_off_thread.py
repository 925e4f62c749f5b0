"""Admission never waits on the host tier: with a tier whose lookups may block (a Ray actor),
a waiting sequence's lookup runs off the scheduling thread, once per sequence, and the step
plans the running rows meanwhile; the sequence is admitted with its tier hits once the answer
is in. A lookup changes no recency in the tier: only a restore (an admitted sequence) does."""

from __future__ import annotations

import threading

import numpy as np

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.worker.engine.request import SeqStatus
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.scheduler_harness import BS, new_seq, run_step


class _GatedLookups(HostTierStore):
    """Lookups wait for ``gate``; each records whether it ran on the scheduling thread."""

    def __init__(self, scheduling_thread: int) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.scheduling_thread = scheduling_thread
        self.calls = 0
        self.on_scheduling_thread = 0

    def lookup(self, hashes, ranks):
        self.calls += 1
        if threading.get_ident() == self.scheduling_thread:
            self.on_scheduling_thread += 1  # would stall every row of the step
            return 0
        self.entered.set()
        assert self.gate.wait(30)
        return super().lookup(hashes, ranks)


def test_a_blocked_tier_lookup_never_holds_the_step_and_runs_once() -> None:
    store = _GatedLookups(threading.get_ident())
    lookup = TierLookup(store, background=True)
    s = Scheduler(SchedulerConfig(), KVCacheManager(32, BS), tier=lookup)
    decoding = new_seq(prompt_len=3, max_tokens=20)  # under a block: no lookup
    s.add([decoding])
    run_step(s)
    waiting = new_seq(prompt_len=13)
    store.put(0, waiting.block_hashes[:3], np.zeros((3, 8), dtype=np.uint8))
    store.put(0, [b"z" * 16], np.zeros((1, 8), dtype=np.uint8))  # stored after: hotter
    order = list(store._blocks)
    s.add([waiting])
    for _ in range(3):  # the tier does not answer: the decode row runs, the lookup waits
        out = run_step(s)
        assert [x.seq for x in out.scheduled] == [decoding]
        assert waiting.status is SeqStatus.WAITING
    assert store.entered.wait(30)  # asked, on another thread
    assert store.on_scheduling_thread == 0 and store.calls == 1
    store.gate.set()
    assert lookup.wait(30)
    out = run_step(s)
    assert waiting in [x.seq for x in out.scheduled] and waiting.num_cached_tokens == 3 * BS
    assert [r.seq for r in out.restores] == [waiting] and len(out.plan.block_restores) == 3
    assert store.calls == 1  # once per sequence
    assert list(store._blocks) == order  # the lookup touched no recency


def test_a_lookup_of_a_sequence_never_admitted_touches_nothing() -> None:
    store = HostTierStore(1 << 20)
    kv = KVCacheManager(4, BS)
    seq = new_seq(prompt_len=13, max_tokens=1)  # 4 blocks: 3 from the tier, 1 computed
    store.put(0, seq.block_hashes[:3], np.zeros((3, 8), dtype=np.uint8))
    store.put(0, [b"z" * 16], np.zeros((1, 8), dtype=np.uint8))
    order = list(store._blocks)
    s = Scheduler(SchedulerConfig(), kv, tier=TierLookup(store))
    hog = new_seq(prompt_len=3, max_tokens=5)
    s.add([hog])
    run_step(s)
    s.add([seq])  # too few free blocks while the hog runs: looked up, not admitted
    for _ in range(3):
        run_step(s)
    assert seq.status is SeqStatus.WAITING and hog.status is SeqStatus.RUNNING
    assert list(store._blocks) == order


def test_an_engine_with_background_lookups_restores_and_equals_recompute(tiny_llama_dir) -> None:
    from tests.unit.worker.engine_harness import prompt, request
    from tests.unit.worker.kv_tier.tier_harness import (
        evict_then_ask_again,
        parity_error,
        restored_blocks,
        tier_engine,
    )

    engine, rec, tier, store = tier_engine(tiny_llama_dir)
    engine.scheduler.tier.lookup = TierLookup(store, background=True)  # as a replica's
    base = prompt(22, seed=85)
    again = request(base + prompt(2, seed=86), max_tokens=3)
    results = evict_then_ask_again(engine, tier, base, again)
    assert restored_blocks(rec, again.request_id) == 5
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    assert engine.scheduler.tier.lookup.pending == 0
    engine.kv.check_invariants()
