"""The packed int8 / int4 kernel against the same weights dequantized and multiplied in fp32:
every row-tile width, output tails, group boundaries, both scale dtypes, bias; the torch
path agrees; without a compiler the projection still runs."""

from __future__ import annotations

import pytest
import torch

from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.quant import kernels
from kvfleet.worker.runner.quant.linear import QuantLinear
from kvfleet.worker.runner.quant.packed import pack_codes, quantize
from kvfleet.worker.runner.quant.tensor import QuantTensor

# (out, in, group): an output tail of 5 lanes, groups of 8 / 32 / 64 / one per row, a
# group size that is not a power of two, more outputs than one panel.
SHAPES = [(37, 96, 32), (5, 40, 8), (64, 128, 64), (80, 48, 48), (33, 60, 12), (200, 320, 32)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 17]  # every tile width, and two tiles plus a tail


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    # fp32 accumulation in another order: relative to the sum of |terms| per output
    bound = (x.abs().double() @ w.abs().double().t()) * 1e-5 + 1e-6
    assert ((y.double() - want).abs() <= bound).all(), float(((y - want.float()).abs() / bound).max())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out, inputs, group", SHAPES)
def test_kernel_matches_dequantized_matmul(bits, out, inputs, group) -> None:
    lib = kernels.load()
    assert lib is not None
    g = torch.Generator().manual_seed(out * inputs + bits)
    packed = quantize(torch.randn(out, inputs, generator=g), bits, group)
    w = packed.dequantize()
    bias = torch.randn(out, generator=g)
    for rows in ROWS:
        x = torch.randn(rows, inputs, generator=g)
        _check(kernels.qmatmul_c(x, packed, None, lib), x, w, None)
        _check(kernels.qmatmul_c(x, packed, bias, lib), x, w, bias)
        torch.testing.assert_close(kernels.qmatmul_torch(x, packed, bias), x @ w.t() + bias,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_thread_splits_give_the_same_outputs(bits) -> None:
    """Threads take contiguous runs of panels and read ahead into the next one: every split
    (an odd panel count over 1 to 3 threads, the last panel reading nothing ahead) gives the
    same bits, equal to the dequantized product."""
    lib = kernels.load()
    assert lib is not None
    g = torch.Generator().manual_seed(bits)
    packed = quantize(torch.randn(7 * 32 - 3, 160, generator=g), bits, 32)  # 7 panels, a tail
    w = packed.dequantize()
    before = torch.get_num_threads()
    try:
        for rows in (1, 9):
            x = torch.randn(rows, 160, generator=g)
            outputs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outputs.append(kernels.qmatmul_c(x, packed, None, lib))
            _check(outputs[0], x, w, None)
            assert all(torch.equal(y, outputs[0]) for y in outputs[1:])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [8, 4])
def test_fp32_scales_and_strided_rows(bits) -> None:
    """Scales that are not exact in fp16 are kept in fp32 (the kernel reads both); ``x`` may
    be a view with a row stride."""
    g = torch.Generator().manual_seed(bits)
    lo, hi = (-127, 128) if bits == 8 else (0, 16)
    codes = torch.randint(lo, hi, (48, 64), generator=g)
    scale = torch.rand(48, 2, generator=g) / 7  # 1/7ths: not exact in fp16
    offset = None if bits == 8 else torch.randn(48, 2, generator=g)
    packed = pack_codes(bits, codes, scale, offset)
    assert packed.scale.dtype == torch.float32
    wide = torch.randn(6, 100, generator=g)
    x = wide[:, 10:74]  # row stride 100
    _check(kernels.qmatmul_c(x, packed, None, kernels.load()), x, packed.dequantize(), None)


def test_empty_batch_and_wrong_width() -> None:
    packed = quantize(torch.randn(16, 32), 8, 32)
    lib = kernels.load()
    assert kernels.qmatmul_c(torch.empty(0, 32), packed, None, lib).shape == (0, 16)
    with pytest.raises(ValueError, match="32 inputs"):
        kernels.qmatmul_c(torch.ones(1, 31), packed, None, lib)


def test_without_a_compiler_the_projection_runs_in_torch(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        w = torch.randn(24, 64)
        lin = QuantLinear(QuantTensor(quantize(w, 4, 32)).t(), torch.randn(24))
        assert lin._product is None
        x = torch.randn(3, 64)
        torch.testing.assert_close(lin(x), x @ lin.weight.dequantize().t() + lin.bias)
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_activation_dtypes_take_the_torch_path(dtype) -> None:
    w = torch.randn(20, 32)
    lin = QuantLinear(QuantTensor(quantize(w, 8, 32), dtype).t())
    x = torch.randn(2, 32, dtype=dtype)
    y = lin(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y, x @ lin.weight.dequantize().to(dtype).t())
