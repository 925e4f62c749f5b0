"""How a rank's KV blocks move between its pool and host memory for the tier.

The pool is ``data`` of shape ``(num_layers, 2, num_blocks, block_size, num_local_kv_heads,
head_dim)``; a run of ``n`` blocks travels block-major, ``(n, num_layers, 2, block_size,
num_local_kv_heads, head_dim)``, on the host.

* :class:`HostCopies` (a CPU pool): plain copies on the calling thread.
* :class:`CudaCopies` (a CUDA pool): copies on a side stream through pinned host buffers, so
  the engine thread never waits for a device ↔ host transfer. The step's own stream waits,
  on the device, only for what it depends on: the pool blocks a write-back reads are gathered
  before a later forward may overwrite them, and restored blocks land before the forward that
  reads them. Not exercised by the CPU test suite (no GPU here); docs/kv_tier.md says what was
  verified.

:func:`device_copies` picks one for a pool's device.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

# A write-back's snapshot: called on the writer thread, returns the run on the host.
Snapshot = Callable[[], torch.Tensor]


class DeviceCopies(Protocol):
    """Moves runs of blocks between ``data`` (the pool) and host memory."""

    def snapshot(self, data: torch.Tensor, blocks: Sequence[int]) -> Snapshot:
        """Capture ``blocks`` now (the pool may reuse them once this returns); the returned
        callable gives the run ``(n, L, 2, bs, H, D)`` on the host, contiguous."""
        ...

    def restore(self, data: torch.Tensor, blocks: Sequence[int], run: torch.Tensor) -> None:
        """Copy the host ``run`` ``(n, L, 2, bs, H, D)`` (``data``'s dtype) into ``blocks``,
        ordered before the next forward on the step's stream."""
        ...


class HostCopies:
    """A CPU pool: the snapshot is one gather copy on the step path; the block-major
    reordering runs on the writer thread."""

    def snapshot(self, data: torch.Tensor, blocks: Sequence[int]) -> Snapshot:
        idx = torch.tensor(list(blocks), dtype=torch.long)
        taken = data[:, :, idx]  # (L, 2, n, bs, H, D): a copy (advanced indexing)
        return lambda: taken.permute(2, 0, 1, 3, 4, 5).contiguous()

    def restore(self, data: torch.Tensor, blocks: Sequence[int], run: torch.Tensor) -> None:
        idx = torch.tensor(list(blocks), dtype=torch.long)
        data[:, :, idx] = run.permute(1, 2, 0, 3, 4, 5)


class CudaCopies:
    """A CUDA pool: gathers, scatters and transfers on one side stream of ``device``.

    Pinned staging buffers are kept alive until their copy's event completes (a pinned
    buffer freed mid-copy would be reused by the allocator under the DMA).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(list(blocks), dtype=torch.long).pin_memory()
        idx = idx.to(self.device, non_blocking=True)  # on the step's stream
        idx.record_stream(self.stream)  # freed only after the side stream's use
        return idx

    def snapshot(self, data: torch.Tensor, blocks: Sequence[int]) -> Snapshot:
        step = torch.cuda.current_stream(self.device)
        idx = self._index(blocks)
        self.stream.wait_stream(step)  # the gather sees every KV write queued so far
        with torch.cuda.stream(self.stream):
            run = data[:, :, idx].permute(2, 0, 1, 3, 4, 5).contiguous()
            gathered = torch.cuda.Event()
            gathered.record(self.stream)
            host = torch.empty(run.shape, dtype=run.dtype, pin_memory=True)
            host.copy_(run, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        step.wait_event(gathered)  # a later forward may overwrite the blocks only after this

        def wait() -> torch.Tensor:
            copied.synchronize()  # the writer thread waits, never the step
            return host

        return wait

    def restore(self, data: torch.Tensor, blocks: Sequence[int], run: torch.Tensor) -> None:
        self._release_done()
        staged = torch.empty(run.shape, dtype=run.dtype, pin_memory=True)
        staged.copy_(run)  # host → pinned (host memory copy)
        step = torch.cuda.current_stream(self.device)
        idx = self._index(blocks)
        self.stream.wait_stream(step)  # the blocks' earlier readers and writers come first
        with torch.cuda.stream(self.stream):
            src = staged.to(self.device, non_blocking=True)
            data[:, :, idx] = src.permute(1, 2, 0, 3, 4, 5)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        step.wait_event(landed)  # the forward that reads them runs after the copy
        self._in_flight.append((landed, staged))

    def _release_done(self) -> None:
        self._in_flight = [(e, t) for e, t in self._in_flight if not e.query()]


def device_copies(device: torch.device) -> DeviceCopies:
    """:class:`CudaCopies` for a CUDA pool, :class:`HostCopies` otherwise."""
    return CudaCopies(device) if device.type == "cuda" else HostCopies()
