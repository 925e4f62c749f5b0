"""Projections: the packed oneDNN path and the one-row C GEMV equal a plain matmul."""

from __future__ import annotations

import pytest
import torch

from kvfleet.worker import cpu_kernels
from kvfleet.worker.models.linear import Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("one_row_copy", [False, True])
def test_linear_matches_matmul(rows, bias, one_row_copy) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 45, generator=g)  # [in, out]; 45 outputs: not a multiple of 4
    b = torch.randn(45, generator=g) if bias else None
    x = torch.randn(rows, 70, generator=g)
    lin = Linear(w, b, one_row_copy=one_row_copy)
    assert lin.packed  # fp32 CPU: this torch build packs for oneDNN
    assert (lin.rows is not None) == one_row_copy
    want = x @ w + (b if bias else 0)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-4)
    assert lin.nbytes == (70 * 45 + (45 if bias else 0)) * 4


def test_gemv_rejects_mismatched_shapes() -> None:
    assert cpu_kernels.load() is not None
    with pytest.raises(ValueError, match="gemv"):
        cpu_kernels.gemv(torch.ones(1, 5), torch.ones(3, 4), None)


def test_non_fp32_falls_back_to_plain_matmul() -> None:
    w = torch.randn(8, 6, dtype=torch.float64)
    lin = Linear(w, one_row_copy=True)
    assert not lin.packed and lin.rows is None
    x = torch.randn(1, 8, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ w)
