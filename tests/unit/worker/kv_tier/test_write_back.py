"""Write-back never blocks the step: a save returns once its snapshot is taken even while the
tier is stuck; past ``max_pending_bytes`` queued, what does not fit is dropped and counted; the
snapshot is what was in the block when it was evicted, whatever the pool writes there after."""

from __future__ import annotations

import threading

import torch

from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.runner.kv_cache import KVCache
from kvfleet.worker.runner.model_config import load_model_config


class _StuckStore(HostTierStore):
    """A tier whose puts wait until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.release = threading.Event()

    def put(self, rank, hashes, run, tag=b""):
        assert self.release.wait(30)
        return super().put(rank, hashes, run)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_saves_return_while_the_tier_is_stuck_and_overflow_is_dropped(tiny_llama_dir) -> None:
    kv = KVCache(load_model_config(tiny_llama_dir), num_blocks=4, block_size=4)
    block_bytes = kv.nbytes // 4
    kv.data[:, :, 0] = 1.0
    store = _StuckStore()
    tier = RankTier(store, 0, kv, max_pending_bytes=2 * block_bytes)
    try:
        tier.save([0], [_h(0)])              # queued; its put is stuck
        kv.data[:, :, 0] = 7.0               # the pool reuses the block at once
        # Room for one more: _h(1) is queued, _h(2) dropped, nothing waited for.
        assert tier.save([1, 2], [_h(1), _h(2)]) == 1
        assert tier.stats.dropped_write_backs == 1 and tier.pending_bytes == 2 * block_bytes
        store.release.set()
        assert tier.flush()
        assert tier.stats.write_backs == 2 and tier.pending_bytes == 0
        assert store.lookup([_h(0), _h(1), _h(2)], [0]) == 2
        restored = [3]
        assert tier.restore(restored, [_h(0)])
        assert torch.all(kv.data[:, :, 3] == 1.0)  # the block as it was when evicted
    finally:
        store.release.set()
        tier.close()
