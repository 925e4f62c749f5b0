"""Packing: codes and groups round-trip, round-to-nearest stays within half a step, fused
weights concatenate, rows are looked up, bad layouts are refused naming the sizes."""

from __future__ import annotations

import pytest
import torch

from kvfleet.worker.runner.quant.packed import (
    QuantLayoutError,
    concat_outputs,
    pack_codes,
    quantize,
)


@pytest.mark.parametrize("bits, group", [(8, 32), (8, 7), (4, 32), (4, 6)])
def test_unpack_returns_what_was_packed(bits, group) -> None:
    g = torch.Generator().manual_seed(group)
    lo, hi = (-128, 128) if bits == 8 else (0, 16)
    codes = torch.randint(lo, hi, (35, 4 * group), generator=g)
    scale = torch.rand(35, 4, generator=g).half().float()
    offset = None if bits == 8 else torch.randn(35, 4, generator=g).half().float()
    packed = pack_codes(bits, codes, scale, offset)
    assert packed.scale.dtype == torch.float16  # exact in fp16: stored so
    got_codes, got_scale, got_offset = packed.unpack()
    assert torch.equal(got_codes.long(), codes) and torch.equal(got_scale.float(), scale)
    assert (got_offset is None) == (offset is None)
    w = packed.dequantize()
    want = scale.repeat_interleave(group, 1) * codes.float()
    if offset is not None:
        want = want + offset.repeat_interleave(group, 1)
    assert torch.equal(w, want)
    rows = torch.tensor([34, 0, 17, 17])
    assert torch.equal(packed.rows(rows), w[rows])


@pytest.mark.parametrize("bits", [8, 4])
def test_round_to_nearest_is_deterministic_and_within_half_a_step(bits) -> None:
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(bits)) * 3
    a, b = quantize(w, bits, 32), quantize(w.clone(), bits, 32)
    assert all(torch.equal(x, y) for x, y in zip(a.unpack()[:2], b.unpack()[:2], strict=True))
    step = a.unpack()[1].float().repeat_interleave(32, 1)
    err = (a.dequantize() - w).abs()
    # half a step, plus the fp16 rounding of the group's offset (int4)
    assert (err <= step * 0.5 + w.abs().amax() * 1e-3).all()
    assert a.nbytes == a.codes.nbytes + a.scale.nbytes + (a.offset.nbytes if bits == 4 else 0)


def test_zero_groups_quantize_to_zero() -> None:
    w = torch.zeros(16, 64)
    w[:, 32:] = 1.0
    for bits in (8, 4):
        d = quantize(w, bits, 32).dequantize()
        assert torch.equal(d[:, :32], torch.zeros(16, 32))
        torch.testing.assert_close(d[:, 32:], torch.ones(16, 32), rtol=1e-3, atol=0)  # fp16 scale


def test_concat_outputs_is_the_fused_weight() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [quantize(torch.randn(n, 64, generator=g), 4, 32) for n in (20, 7, 7)]
    fused = concat_outputs(parts)
    assert fused.out_features == 34
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(QuantLayoutError, match="share bits"):
        concat_outputs([parts[0], quantize(torch.randn(4, 64), 8, 32)])


def test_bad_layouts_are_refused_naming_sizes() -> None:
    with pytest.raises(QuantLayoutError, match="100 inputs do not split into groups of 32"):
        quantize(torch.randn(4, 100), 4, 32)
    with pytest.raises(QuantLayoutError, match="even"):
        quantize(torch.randn(4, 99), 4, 3)
    with pytest.raises(QuantLayoutError, match=r"\[0, 15\]"):
        pack_codes(4, torch.full((2, 4), 16), torch.ones(2, 1), torch.zeros(2, 1))
    with pytest.raises(QuantLayoutError, match="offsets must be absent"):
        pack_codes(8, torch.zeros(2, 4, dtype=torch.int8), torch.ones(2, 1), torch.zeros(2, 1))
    with pytest.raises(QuantLayoutError, match="bits must be one of"):
        quantize(torch.randn(4, 32), 3, 32)
