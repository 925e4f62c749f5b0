"""The fused layer ops in C (layer_ops.c) against the torch formulations they replace: decode
rows (one thread) and prefill-sized rows (split between threads), partial rotary, a strided
qkv, the K/V written to shuffled cache slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfleet.worker.runner import layer_ops
from kvfleet.worker.runner.attention import write_kv
from kvfleet.worker.runner.models.llama import rms_norm
from kvfleet.worker.runner.models.rope import apply_rope

ROWS = (1, 16, 130)  # one decode, a decode batch, a prefill chunk (threaded)


@pytest.fixture(autouse=True)
def _needs_kernels() -> None:
    assert layer_ops.applies(torch.zeros(1)), "the C kernels must build on the test machine"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
    weight = torch.randn(96, generator=g)
    total, normed = layer_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    _close(normed, rms_norm(x + delta, weight, 1e-6))
    same, normed = layer_ops.add_rms_norm(x, None, weight, 1e-6)
    assert same is x
    _close(normed, rms_norm(x, weight, 1e-6))
    want, owned = x + delta, x.clone()
    total, normed = layer_ops.add_rms_norm(owned, delta, weight, 1e-6, in_place=True)
    assert total is owned and torch.equal(total, want)
    _close(normed, rms_norm(want, weight, 1e-6))


def test_add_rms_norm_strided_rows() -> None:
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 200, generator=g)
    x, delta, weight = wide[:, :64], wide[:, 100:164], torch.randn(64, generator=g)
    total, normed = layer_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    _close(normed, rms_norm(x + delta, weight, 1e-5))
    with pytest.raises(ValueError):
        layer_ops.add_rms_norm(x, delta, torch.ones(63), 1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("rotary", [16, 10])  # whole heads, partial rotary
def test_rope_write_kv(rows: int, rotary: int) -> None:
    heads, kv_heads, dim = 6, 2, 16
    g = torch.Generator().manual_seed(rows + rotary)
    wide = torch.randn(rows, (heads + 2 * kv_heads) * dim + 8, generator=g)
    qkv = wide[:, 3: 3 + (heads + 2 * kv_heads) * dim]  # row stride past the row
    angles = torch.rand(rows, 1, rotary // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    k_end = (heads + kv_heads) * dim
    want_qk = apply_rope(qkv[:, :k_end].reshape(rows, heads + kv_heads, dim), cos, sin)
    value = qkv[:, k_end:].reshape(rows, kv_heads, dim).clone()
    caches = [torch.zeros(48, 4, kv_heads, dim) for _ in range(4)]
    slots = torch.randperm(48 * 4, generator=g)[:rows]
    write_kv(want_qk[:, heads:], value, caches[0], caches[1], slots)
    layer_ops.rope_write_kv(qkv, cos, sin, heads, kv_heads, dim, caches[2], caches[3], slots)
    _close(qkv[:, :k_end].reshape(rows, heads + kv_heads, dim), want_qk)
    assert torch.equal(qkv[:, k_end:].reshape(rows, kv_heads, dim), value)
    _close(caches[2], caches[0])
    assert torch.equal(caches[3], caches[1])
    untouched = qkv.clone()
    layer_ops.rope_write_kv(untouched, torch.ones_like(cos), torch.zeros_like(sin), heads,
                            kv_heads, dim)  # no caches: RoPE only; angle 0 keeps every value
    assert torch.equal(untouched, qkv)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 72, generator=g) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    _close(layer_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_silu_over_the_float_range() -> None:
    """The kernel's own exp: as close to silu in float64 as torch's silu is, extremes included."""
    x = torch.cat([torch.linspace(-200, 200, 40_000), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    got = layer_ops.silu_mul(torch.stack([x, torch.ones_like(x)], 1)).view(-1)  # width 1
    exact = F.silu(x.double())
    err = (got.double() - exact).abs()
    assert float(err.max()) <= 1e-5
    assert float((err / exact.abs().clamp_min(1e-30))[x.abs() < 80].max()) <= 4 * float(
        ((F.silu(x).double() - exact).abs() / exact.abs().clamp_min(1e-30))[x.abs() < 80].max())
