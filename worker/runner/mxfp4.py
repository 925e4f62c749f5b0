"""MXFP4 expert weights (gpt-oss checkpoints) dequantized at load.

The OCP Microscaling format: blocks of 32 FP4 (E2M1) values share one E8M0 scale. An E2M1
code is a sign bit, two exponent bits and one mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6. An E8M0 scale byte ``s`` is the power of two ``2 ** (s - 127)``. gpt-oss stores a
weight ``W`` (``[E, out, in]``) as ``W_blocks`` ``[E, out, in / 32, 16]`` uint8, two codes a
byte, the low nibble first, and ``W_scales`` ``[E, out, in / 32]`` uint8; the float tensor it
stands for is named ``W`` and laid out ``[E, in, out]`` (as the checkpoint's float export).

The engine runs the experts in float: the values are decoded once here, before the
tensor-parallel slice is taken.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# E2M1 code → value: codes 0-7 positive, 8-15 the same magnitudes negated.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per shared scale
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` ``[..., G, 16]`` uint8 and ``scales`` ``[..., G]`` uint8 → ``[..., G * 32]``
    values in ``dtype`` (each byte's low nibble first).

    Raises:
        ValueError: a dtype other than uint8, or shapes that do not pair up.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not pair with scales "
                         f"{tuple(scales.shape)} (want [..., G, {BLOCK // 2}] and [..., G])")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def dequantize_checkpoint(weights: dict[str, torch.Tensor], dtype: torch.dtype | None,
                          then: Callable[[str, torch.Tensor], torch.Tensor]
                          ) -> dict[str, torch.Tensor]:
    """``weights`` with every ``W_blocks`` / ``W_scales`` pair replaced by ``W`` ``[E, in,
    out]`` in ``dtype`` (float32 when None), passed through ``then(name, tensor)`` (this
    rank's slice). A checkpoint without MXFP4 tensors comes back as it is.

    Raises:
        KeyError: a ``W_blocks`` without its ``W_scales``.
        ValueError: see :func:`dequantize`.
    """
    names = [n for n in weights if n.endswith(BLOCKS)]
    for name in names:
        base = name[: -len(BLOCKS)]
        if base + SCALES not in weights:
            raise KeyError(f"{name}: MXFP4 blocks without {base + SCALES}")
        w = dequantize(weights.pop(name), weights.pop(base + SCALES), dtype or torch.float32)
        weights[base] = then(base, w.transpose(-1, -2).contiguous())
    return weights
