"""Projections: the packed oneDNN path and the few-row C kernel equal a plain matmul; without a
C compiler everything falls back."""

from __future__ import annotations

import pytest
import torch

from kvfleet.worker.engine.step_plan import SeqChunk
from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.attention import build_attention_metadata
from kvfleet.worker.runner.models.linear import FEW_ROWS, Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, FEW_ROWS, FEW_ROWS + 1])
@pytest.mark.parametrize("one_row_copy", [False, True])
def test_linear_matches_matmul(rows, bias, one_row_copy) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 45, generator=g)  # [in, out]; 45 outputs: not a multiple of 4
    b = torch.randn(45, generator=g) if bias else None
    x = torch.randn(rows, 70, generator=g)
    lin = Linear(w, b, one_row_copy=one_row_copy)
    assert lin.packed  # fp32 CPU: this torch build packs for oneDNN
    assert (lin.panels is not None) == one_row_copy
    want = x @ w + (b if bias else 0)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-4)
    assert lin.nbytes == (70 * 45 + (45 if bias else 0)) * 4


@pytest.mark.parametrize("rows", [*range(1, 19), 31, 36, FEW_ROWS - 1, FEW_ROWS, FEW_ROWS + 3])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (33, 130)])
def test_few_row_kernel_matches_torch(rows, shape) -> None:
    """Every row count through the tile and its remainders (1..7 rows past a multiple of eight),
    several full tiles over one panel, up to and beyond FEW_ROWS, outputs a multiple of the
    panel width or not, with and without bias: the kernel equals torch's matmul within fp32
    accumulation error."""
    assert cpu_kernels.load() is not None
    g = torch.Generator().manual_seed(rows * 7 + shape[1])
    w = torch.randn(*shape, generator=g)  # [in, out]
    b = torch.randn(shape[1], generator=g)
    x = torch.randn(rows, shape[0], generator=g)
    panels = cpu_kernels.pack_panels(w)
    want = (x.double() @ w.double()).float()
    tol = 2e-6 * shape[0] ** 0.5 * float(want.abs().max())
    torch.testing.assert_close(cpu_kernels.gemv(x, panels, None, shape[1]), want, rtol=0, atol=tol)
    torch.testing.assert_close(cpu_kernels.gemv(x, panels, b, shape[1]), want + b, rtol=0, atol=tol)
    # torch's own fp32 product carries an error of the same size: twice the bound between them
    torch.testing.assert_close(cpu_kernels.gemv(x, panels, None, shape[1]), x @ w, rtol=0, atol=2 * tol)


@pytest.mark.parametrize("shape", [(576, 960), (33, 130)])
def test_few_row_kernel_rows_do_not_depend_on_their_neighbours(shape) -> None:
    """A row's outputs are bit for bit the same whatever rows share its tile or its step, up to
    FEW_ROWS rows (every tile count the kernel runs): a verify chunk's rows, or a decode row
    beside a prefill chunk, get exactly the projections each would get as a one-row decode."""
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[1], generator=g)
    x = torch.randn(FEW_ROWS, shape[0], generator=g)
    panels = cpu_kernels.pack_panels(w)
    alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], panels, b, shape[1]) for i in range(FEW_ROWS)])
    for rows in range(2, FEW_ROWS + 1):
        assert torch.equal(cpu_kernels.gemv(x[:rows], panels, b, shape[1]), alone[:rows]), rows
    for start in (1, 5, 8, 13):  # the same rows at other places in their tiles
        got = cpu_kernels.gemv(x[start:], panels, b, shape[1])
        assert torch.equal(got, alone[start:]), start


def test_few_rows_route_by_row_count(monkeypatch) -> None:
    """Products of 1..FEW_ROWS rows take the C kernel, longer ones the packed GEMM."""
    calls = []
    real = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    lin = Linear(torch.randn(40, 24), one_row_copy=True)
    for rows in (1, FEW_ROWS, FEW_ROWS + 1):
        lin(torch.randn(rows, 40))
    assert calls == [1, FEW_ROWS]


def test_gemv_rejects_mismatched_shapes() -> None:
    assert cpu_kernels.load() is not None
    panels = cpu_kernels.pack_panels(torch.ones(4, 3))
    with pytest.raises(ValueError, match="gemv"):
        cpu_kernels.gemv(torch.ones(1, 5), panels, None, 3)
    with pytest.raises(ValueError, match="gemv"):
        cpu_kernels.gemv(torch.ones(0, 4), panels, None, 3)
    with pytest.raises(ValueError, match="gemv"):
        cpu_kernels.gemv(torch.ones(1, 4), panels, None, 300)


def test_non_fp32_falls_back_to_plain_matmul() -> None:
    w = torch.randn(8, 6, dtype=torch.float64)
    lin = Linear(w, one_row_copy=True)
    assert not lin.packed and lin.panels is None
    x = torch.randn(1, 8, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ w)


def test_without_a_compiler_everything_falls_back(monkeypatch, tmp_path, caplog) -> None:
    """No C compiler: the library does not load (logged), projections keep one packed copy,
    attention takes the torch path — and results stay the same."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cpu_kernels.load() is None
        assert "torch path" in caplog.text
        w = torch.randn(16, 8)
        lin = Linear(w, one_row_copy=True)
        assert lin.packed and lin.panels is None
        x = torch.randn(1, 16)
        torch.testing.assert_close(lin(x), x @ w, rtol=1e-5, atol=1e-5)
        meta = build_attention_metadata((SeqChunk("a", (0,), 3, (1,)),), 4, (None,))
        assert meta.decode_kernel is None and len(meta.decode_tables) == 1
    finally:
        cpu_kernels.load.cache_clear()
