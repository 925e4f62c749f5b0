"""LoraBatch: rows grouped by adapter, contiguous (a slice) or not (gather/scatter), give each
row its own adapter's update and the base rows none."""

import torch

from kvfleet.worker.runner.lora.slots import LoraBatch, LoraSlots


def test_segments_apply_each_rows_own_adapter() -> None:
    g = torch.Generator().manual_seed(0)
    slots = LoraSlots(2)
    ab = {s: (torch.randn(6, 3, generator=g), torch.randn(3, 5, generator=g)) for s in (1, 2)}
    for s, w in ab.items():
        slots.install(s, {(0, "qkv"): w})
    chunk_slots, lens = [1, 0, 2, 1], [2, 1, 3, 1]  # adapter 1's rows are not contiguous
    batch = LoraBatch.build(slots, chunk_slots, lens, torch.device("cpu"))
    assert {type(rows) for _, rows in batch.segments} == {torch.Tensor, slice}
    x, y = torch.randn(7, 6, generator=g), torch.zeros(7, 5)
    batch.apply(0, "qkv", x, y)
    batch.apply(1, "qkv", x, y)  # a layer no adapter targets: nothing added
    row_slot = [s for s, n in zip(chunk_slots, lens) for _ in range(n)]
    for r, s in enumerate(row_slot):
        want = torch.zeros(5) if s == 0 else x[r] @ ab[s][0] @ ab[s][1]
        assert torch.allclose(y[r], want, atol=1e-5)
    assert LoraBatch.build(slots, [0, 0], [1, 2], torch.device("cpu")) is None
