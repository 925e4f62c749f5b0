"""The tier's block copies between a pool and host memory (CPU pool; the CUDA variant needs a
GPU and is not run here: docs/kv_tier.md)."""

from __future__ import annotations

import torch

from kvfleet.worker.kv_tier.device_copy import HostCopies, device_copies

# (num_layers, 2, num_blocks, block_size, num_local_kv_heads, head_dim)
SHAPE = (3, 2, 8, 4, 2, 5)


def pool() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


def test_a_cpu_pool_gets_plain_host_copies() -> None:
    assert isinstance(device_copies(torch.device("cpu")), HostCopies)


def test_a_snapshot_is_block_major_and_survives_the_pool_reusing_its_blocks() -> None:
    data, copies = pool(), HostCopies()
    expected = torch.stack([data[:, :, b] for b in (5, 1)])  # (n, L, 2, bs, H, D)
    snap = copies.snapshot(data, [5, 1])
    data[:, :, [5, 1]] = -1.0  # the pool reuses the blocks as soon as save returns
    run = snap()
    assert run.shape == (2, *SHAPE[:2], *SHAPE[3:]) and run.is_contiguous()
    assert torch.equal(run, expected)


def test_restore_writes_the_run_into_exactly_its_blocks() -> None:
    data, copies = pool(), HostCopies()
    run = copies.snapshot(data, [0, 3])()
    before = data.clone()
    copies.restore(data, [6, 2], run)
    assert torch.equal(data[:, :, 6], before[:, :, 0]) and torch.equal(data[:, :, 2], before[:, :, 3])
    untouched = [b for b in range(SHAPE[2]) if b not in (6, 2)]
    assert torch.equal(data[:, :, untouched], before[:, :, untouched])
