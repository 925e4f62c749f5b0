"""Write-back in runs: a save larger than the queue's room queues the leading blocks that fit,
in runs of at most ``max_run_bytes`` (one put each), and says how many it queued; a snapshot
that raises gives its queued bytes back (nothing stays pending for ever); each queued run has
its own completion, so a caller waits for its own put, not for the writer to go idle."""

from __future__ import annotations

import threading

import pytest
import torch

from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.runner.kv_cache import KVCache
from kvfleet.worker.runner.model_config import load_model_config


class _GatedStore(HostTierStore):
    """A tier whose puts of a hash in ``gated`` wait until ``release`` is set; records every
    put's hashes."""

    def __init__(self, gated=()) -> None:
        super().__init__(1 << 30)
        self.gated = set(gated)
        self.release = threading.Event()
        self.puts: list[list[bytes]] = []

    def put(self, rank, hashes, run, tag=b""):
        if self.gated & set(hashes):
            assert self.release.wait(30)
        self.puts.append(list(hashes))
        return super().put(rank, hashes, run, tag)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def kv(tiny_llama_dir) -> KVCache:
    kv = KVCache(load_model_config(tiny_llama_dir), num_blocks=8, block_size=4)
    for b in range(8):
        kv.data[:, :, b] = float(b)
    return kv


def test_a_save_past_the_queue_bound_queues_the_runs_that_fit(kv) -> None:
    block_bytes = kv.nbytes // 8
    store = _GatedStore()
    tier = RankTier(store, 0, kv, max_pending_bytes=5 * block_bytes, max_run_bytes=2 * block_bytes)
    try:
        queued = tier.save(list(range(8)), [_h(i) for i in range(8)])
        assert queued == 5  # not all-or-nothing: the leading 5 fit
        assert tier.stats.dropped_write_backs == 3
        assert tier.flush()
        assert store.puts == [[_h(0), _h(1)], [_h(2), _h(3)], [_h(4)]]  # runs within the cap
        assert store.lookup([_h(i) for i in range(8)], [0]) == 5
        assert tier.stats.write_backs == 5 and tier.pending_bytes == 0
        into = [7]
        assert tier.restore(into, [_h(3)]) and torch.all(kv.data[:, :, 7] == 3.0)
    finally:
        tier.close()


def test_a_snapshot_that_raises_gives_its_bytes_back(kv) -> None:
    block_bytes = kv.nbytes // 8
    store = _GatedStore()
    tier = RankTier(store, 0, kv, max_pending_bytes=4 * block_bytes)
    real = tier.copies

    class _Failing:
        def snapshot(self, data, blocks):
            raise RuntimeError("pinned memory exhausted")

        def restore(self, data, blocks, run):
            real.restore(data, blocks, run)

    try:
        tier.copies = _Failing()
        assert tier.save([0, 1], [_h(0), _h(1)]) == 0  # dropped, never raised into the step
        assert tier.pending_bytes == 0 and tier.stats.dropped_write_backs == 2
        tier.copies = real
        assert tier.save([0, 1, 2, 3], [_h(i) for i in range(4)]) == 4  # the room is whole
        assert tier.flush() and store.lookup([_h(i) for i in range(4)], [0]) == 4
    finally:
        tier.close()


def test_each_run_completes_on_its_own_put(kv) -> None:
    """A later write-back stuck in the tier does not hold back an earlier run's completion."""
    block_bytes = kv.nbytes // 8
    store = _GatedStore(gated={_h(5)})
    tier = RankTier(store, 0, kv, max_pending_bytes=8 * block_bytes)
    try:
        first = tier.save([0, 1], [_h(0), _h(1)])
        assert first == 2
        mine = tier.last_saved.completions
        tier.save([5], [_h(5)])  # stuck until released
        assert [f.result(timeout=30) for f in mine] == [True]
        assert not tier.flush(0.0)  # the writer is not idle: the stuck run is pending
        store.release.set()
        assert tier.flush()
        assert tier.last_saved.completions[0].result(timeout=30) is True
    finally:
        store.release.set()
        tier.close()
