"""GGUF blocks decode to codes + group scales whose dequantization is, bit for bit, what the
``gguf`` package's reference dequantizer computes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kvfleet.worker.runner.quant.gguf_blocks import DECODERS
from kvfleet.worker.runner.quant.packed import dequantize_decoded, pack_codes

# type → (bytes per block, offsets of its fp16 fields): random bytes elsewhere are valid codes
LAYOUTS = {"Q8_0": (34, (0,)), "Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q4_K": (144, (0, 2))}


def _random_blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    size, halves = LAYOUTS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for at in halves:  # finite fp16 scales (random bits could be inf / NaN)
        value = (rng.standard_normal((rows, blocks)) * 0.02).astype(np.float16)
        raw[..., at:at + 2] = value.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_decode_matches_the_reference_dequantizer(kind) -> None:
    raw = _random_blocks(kind, rows=9, blocks=3, seed=len(kind))
    want = quants.dequantize(raw, getattr(GGMLQuantizationType, kind))
    bits, decode = DECODERS[kind]
    decoded = decode(raw)
    assert np.array_equal(dequantize_decoded(decoded).numpy(), want)
    packed = pack_codes(bits, *decoded)  # the packed weight holds the same values
    assert np.array_equal(packed.dequantize().numpy(), want)
    assert packed.group == 32


def test_quantized_by_gguf_round_trips() -> None:
    """Blocks the gguf package quantized itself (not random bytes) decode identically too."""
    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        qtype = getattr(GGMLQuantizationType, kind)
        raw = quants.quantize(x, qtype)
        assert np.array_equal(dequantize_decoded(DECODERS[kind][1](raw)).numpy(),
                              quants.dequantize(raw, qtype))
