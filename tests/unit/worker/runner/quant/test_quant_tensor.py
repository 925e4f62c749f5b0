"""A quantized weight travels a model's load path like its float tensor (fuse, transpose,
move, assign as a parameter, look rows up) and refuses anything else, naming the op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.worker.runner.models.linear import Linear, projection
from kvfleet.worker.runner.quant.linear import QuantLinear
from kvfleet.worker.runner.quant.packed import quantize
from kvfleet.worker.runner.quant.tensor import QuantizedOpError, QuantTensor


def _q(out: int, seed: int, bits: int = 4) -> QuantTensor:
    return QuantTensor(quantize(torch.randn(out, 64, generator=torch.Generator().manual_seed(seed)),
                                bits, 32))


def test_fuse_transpose_assign_and_pack() -> None:
    q, k, v = _q(32, 0), _q(16, 1), _q(16, 2)
    fused = torch.cat([q, k, v])
    assert fused.shape == (64, 64) and fused.nbytes == fused.packed.nbytes
    want = torch.cat([t.packed.dequantize() for t in (q, k, v)])
    with torch.device("meta"):
        module = nn.Module()
        module.w = nn.Parameter(torch.empty(64, 64), requires_grad=False)
    module.load_state_dict({"w": fused.t().contiguous().to(device="cpu", dtype=torch.float32)},
                           strict=True, assign=True)
    for p in module.parameters():
        p.requires_grad_(False)
    proj = projection(module.w, None, one_row_copy=True)
    assert isinstance(proj, QuantLinear) and proj.held_nbytes == fused.packed.nbytes
    x = torch.randn(3, 64)
    torch.testing.assert_close(proj(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    assert isinstance(projection(torch.randn(64, 8)), Linear)


def test_a_tied_table_and_head_share_one_packed_weight() -> None:
    table = _q(100, 3, bits=8)
    head = table.t().contiguous().to("cpu")
    assert head.packed is table.packed
    ids = torch.tensor([[0, 99], [42, 42]])
    rows = F.embedding(ids, table)
    assert rows.shape == (2, 2, 64)
    assert torch.equal(rows, table.packed.dequantize()[ids])


@pytest.mark.parametrize("op", [
    lambda t: torch.stack([t, t]), lambda t: t * 2, lambda t: t.sum(),
    lambda t: torch.cat([t, t], dim=1), lambda t: F.embedding(torch.tensor([0]), t.t()),
])
def test_anything_else_is_refused(op) -> None:
    with pytest.raises(TypeError):
        op(_q(16, 4))


def test_the_refusal_names_the_op() -> None:
    with pytest.raises(QuantizedOpError, match="do not support stack"):
        torch.stack([_q(16, 5), _q(16, 6)])
