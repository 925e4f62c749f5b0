"""A weight held as int8 or int4 codes with group-wise scales, in the layout the kernels read.

Every source (round-to-nearest at load, GGUF blocks, GPTQ/AWQ tensors) ends in
:func:`pack_codes`: integer codes ``[out, in]`` plus per-group scales (and, for int4, offsets)
``[out, in / group]``, one value each per output row and group of ``group`` consecutive inputs.
The dequantized weight is ``scale · q`` (int8, ``q`` in -128..127) or ``scale · q + offset``
(int4, ``q`` in 0..15), computed in fp32 as one multiply and one add.

Packed layout (see ``qgemm.c``): outputs in blocks of :data:`LANES`, zero-padded to a whole
number of :data:`PANEL` blocks;
codes ``[blocks, in, LANES]`` (int8) or ``[blocks, in / 2, LANES]`` (int4: input ``k`` even in
the low nibble, ``k + 1`` in the high one); scales and offsets ``[blocks, in / group, LANES]``
in fp16 (when every value is exact in fp16) or fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Codes [out, in], scale [out, in / group] and, for int4, offset: what pack_codes takes.
Decoded = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]

LANES = 16
PANEL = 2  # blocks a kernel task takes at once: outputs pad to a multiple of PANEL * LANES
BITS = (8, 4)


class QuantLayoutError(ValueError):
    """A weight that cannot be packed as asked (the message names the sizes)."""


def check_group(bits: int, in_features: int, group: int, what: str = "weight") -> None:
    """Refuse a group size that does not tile ``in_features``.

    Raises:
        QuantLayoutError: ``bits`` not 8 or 4, ``group`` < 1 (odd for int4), or
            ``in_features % group != 0``.
    """
    if bits not in BITS:
        raise QuantLayoutError(f"{what}: bits must be one of {BITS}, got {bits}")
    if group < 1 or (bits == 4 and group % 2):
        raise QuantLayoutError(f"{what}: int{bits} group size must be a positive "
                               f"{'even ' if bits == 4 else ''}integer, got {group}")
    if in_features % group:
        raise QuantLayoutError(f"{what}: {in_features} inputs do not split into groups of {group}")


@dataclass(frozen=True)
class PackedWeight:
    """One packed ``[out_features, in_features]`` weight (see the module docstring)."""

    bits: int
    group: int
    in_features: int
    out_features: int
    codes: torch.Tensor  # int8 [blocks, in, LANES] or uint8 [blocks, in / 2, LANES]
    scale: torch.Tensor  # [blocks, in / group, LANES], float16 or float32
    offset: torch.Tensor | None  # int4: like scale; int8: None

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets (padding included)."""
        return sum(t.nbytes for t in (self.codes, self.scale, self.offset) if t is not None)

    @property
    def half_scales(self) -> bool:
        return self.scale.dtype == torch.float16

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same weight on ``device`` (itself when it is there already)."""
        if self.codes.device == torch.device(device):
            return self
        return PackedWeight(self.bits, self.group, self.in_features, self.out_features,
                            self.codes.to(device), self.scale.to(device),
                            None if self.offset is None else self.offset.to(device))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized output rows ``index`` ``(T,)`` → ``(T, in_features)`` fp32 (an
        embedding lookup on a tied table)."""
        blocks, lanes = index // LANES, index % LANES
        codes = self.codes[blocks, :, lanes]  # (T, in) or (T, in / 2)
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(1)
        return dequantize_decoded((codes, self.scale[blocks, :, lanes],
                                   None if self.offset is None else self.offset[blocks, :, lanes]))

    def dequantize(self) -> torch.Tensor:
        """The whole weight ``[out_features, in_features]`` in fp32."""
        return self.rows(torch.arange(self.out_features, device=self.codes.device))

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(codes [out, in], scale [out, in / group], offset or None)``: what
        :func:`pack_codes` took (scales in their stored dtype)."""
        codes = self.codes
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=2).flatten(1, 2)
        return (_unblocked(codes, self.out_features), _unblocked(self.scale, self.out_features),
                None if self.offset is None else _unblocked(self.offset, self.out_features))


def dequantize_decoded(d: Decoded) -> torch.Tensor:
    """``scale · q (+ offset)`` ``[out, in]`` in fp32, one multiply and one add per weight."""
    codes, scale, offset = d
    group = codes.shape[1] // scale.shape[1]
    w = scale.float().repeat_interleave(group, 1) * codes.float()
    return w if offset is None else w + offset.float().repeat_interleave(group, 1)


def _blocked(t: torch.Tensor) -> torch.Tensor:
    """``[out, n]`` → ``[blocks, n, LANES]``, outputs zero-padded to whole panels."""
    out, n = t.shape
    blocks = -(-out // (LANES * PANEL)) * PANEL
    padded = t.new_zeros(blocks * LANES, n)
    padded[:out] = t
    return padded.view(blocks, LANES, n).transpose(1, 2).contiguous()


def _unblocked(t: torch.Tensor, out: int) -> torch.Tensor:
    """Inverse of :func:`_blocked`: ``[blocks, n, LANES]`` → ``[out, n]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:out]


def concat_outputs(weights: list[PackedWeight]) -> PackedWeight:
    """One weight whose outputs are those of ``weights`` in order (fused projections).

    Raises:
        QuantLayoutError: the weights differ in bits, group size or inputs.
    """
    first = weights[0]
    if any((w.bits, w.group, w.in_features) != (first.bits, first.group, first.in_features)
           for w in weights):
        raise QuantLayoutError("fused quantized weights must share bits, group size and inputs: "
                               + ", ".join(f"int{w.bits}/g{w.group}/{w.in_features} in"
                                           for w in weights))
    parts = [w.unpack() for w in weights]
    offset = None if first.offset is None else torch.cat([p[2] for p in parts])  # type: ignore[misc]
    return pack_codes(first.bits, torch.cat([p[0] for p in parts]),
                      torch.cat([p[1].float() for p in parts]),
                      None if offset is None else offset.float())


def _scale_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp16 when every value round-trips through it exactly, else fp32."""
    for t in tensors:
        if t is not None and not torch.equal(t.float().half().float(), t.float()):
            return torch.float32
    return torch.float16


def pack_codes(bits: int, codes: torch.Tensor, scale: torch.Tensor,
               offset: torch.Tensor | None = None) -> PackedWeight:
    """Pack integer ``codes`` ``[out, in]`` with ``scale`` (and int4 ``offset``) ``[out, in / group]``.

    Scales and offsets are stored in fp16 when that is exact for all of them, else fp32: a
    source's values are never rounded here.

    Raises:
        QuantLayoutError: codes out of range, shapes that disagree, a bad group size, an int8
            weight with offsets or an int4 one without.
    """
    out, in_features = codes.shape
    if scale.dim() != 2 or scale.shape[0] != out or scale.shape[1] == 0:
        raise QuantLayoutError(f"scales {tuple(scale.shape)} do not match codes {tuple(codes.shape)}")
    group = in_features // scale.shape[1]
    check_group(bits, in_features, group)
    if group * scale.shape[1] != in_features:
        raise QuantLayoutError(f"{scale.shape[1]} scale groups do not tile {in_features} inputs")
    if (offset is None) != (bits == 8) or (offset is not None and offset.shape != scale.shape):
        raise QuantLayoutError(f"int{bits} weight: offsets must be "
                               f"{'absent' if bits == 8 else f'of shape {tuple(scale.shape)}'}")
    lo, hi = (-128, 127) if bits == 8 else (0, 15)
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise QuantLayoutError(f"int{bits} codes must lie in [{lo}, {hi}]")
    dtype = _scale_dtype(scale, offset)
    if bits == 8:
        packed = _blocked(codes.to(torch.int8))
    else:
        blocked = _blocked(codes.to(torch.uint8))  # [blocks, in, LANES]
        packed = (blocked[:, 0::2] | (blocked[:, 1::2] << 4)).contiguous()
    return PackedWeight(bits, group, in_features, out, packed, _blocked(scale.to(dtype)),
                        None if offset is None else _blocked(offset.to(dtype)))


def quantize(weight: torch.Tensor, bits: int, group: int) -> PackedWeight:
    """Round-to-nearest group-wise quantization of ``weight`` ``[out, in]`` (deterministic).

    int8: symmetric, ``scale = max|w| / 127`` per group. int4: asymmetric, ``scale = (max -
    min) / 15``, ``offset = min``. Scales and offsets are rounded to fp16 first and the codes
    computed against the rounded values.

    Raises:
        QuantLayoutError: see :func:`check_group`.
    """
    out, in_features = weight.shape
    check_group(bits, in_features, group)
    w = weight.detach().float().reshape(out, in_features // group, group)
    if bits == 8:
        scale = (w.abs().amax(-1) / 127).half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / safe[..., None]).clamp(-127, 127)
        return pack_codes(8, codes.reshape(out, in_features).to(torch.int8), scale)
    lo, hi = w.amin(-1), w.amax(-1)
    offset = lo.half().float()
    scale = ((hi - offset) / 15).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((w - offset[..., None]) / safe[..., None]).clamp(0, 15)
    return pack_codes(4, codes.reshape(out, in_features).to(torch.uint8), scale, offset)
