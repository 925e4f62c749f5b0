"""GGUF quant blocks → integer codes with group scales and offsets, without a float round trip.

Each decoder takes one tensor's raw blocks, ``uint8 [rows, row_bytes]`` as GGUF stores them
(a row is one output: its inputs in blocks along the row), and returns ``(codes [rows, cols],
scale [rows, groups], offset [rows, groups] or None)`` in :func:`~.packed.pack_codes`' terms,
so that ``scale · q (+ offset)`` in fp32 is bit for bit what ggml's reference dequantizer
(the ``gguf`` package's ``quants.dequantize``) computes:

* ``Q8_0``: 32 int8 per block, one fp16 ``d``: ``d · q`` → int8, group 32.
* ``Q4_0``: 32 nibbles, ``d``: ``d · (q - 8)`` → int4, offset ``-8 d``, group 32.
* ``Q4_1``: 32 nibbles, ``d`` and ``m``: ``d · q + m`` → int4, group 32.
* ``Q4_K``: super-blocks of 256 in 8 sub-blocks of 32, fp16 ``d``/``dmin`` and 6-bit
  ``sc``/``mn`` per sub-block: ``(d · sc) · q - dmin · mn`` → int4, group 32 (scales in fp32:
  ``d · sc`` is exact there, not in fp16).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kvfleet.worker.runner.quant.packed import Decoded


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    """``uint8 [rows, row_bytes]`` → ``uint8 [rows, blocks, block_bytes]``."""
    rows = raw.shape[0]
    t = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: GGUF memory maps are read-only
    return t.view(rows, -1, block_bytes)


def _f16(t: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from ``uint8 [..., 2]`` → float32 ``[...]``."""
    return t.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes → ``[..., 32]`` codes: the low nibbles first, then the high ones."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def q8_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 34)
    codes = b[..., 2:].contiguous().view(torch.int8).flatten(1)
    return codes, _f16(b[..., :2]), None


def q4_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 18)
    d = _f16(b[..., :2])
    return _nibbles(b[..., 2:]).flatten(1), d, -8 * d


def q4_1(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 20)
    return _nibbles(b[..., 4:]).flatten(1), _f16(b[..., :2]), _f16(b[..., 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes ``[..., 12]`` → 6-bit ``(sc, mn)``, each ``[..., 8]``."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc, mn


def q4_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 144)
    rows, supers = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    # 128 bytes = 4 chunks of 32; chunk j holds sub-block 2j in its low nibbles, 2j + 1 in its high.
    qs = b[..., 16:].reshape(rows, supers, 4, 32)
    codes = torch.stack((qs & 15, qs >> 4), dim=3).reshape(rows, supers * 256)
    scale = (d[..., None] * sc.float()).reshape(rows, supers * 8)
    offset = -(dmin[..., None] * mn.float()).reshape(rows, supers * 8)
    return codes, scale, offset


# GGML type name → (bits, decoder).
DECODERS: dict[str, tuple[int, Callable[[np.ndarray], Decoded]]] = {
    "Q8_0": (8, q8_0), "Q4_0": (4, q4_0), "Q4_1": (4, q4_1), "Q4_K": (4, q4_k),
}
