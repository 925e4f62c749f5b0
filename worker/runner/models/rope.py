"""Rotary position embeddings: cos/sin tables per :class:`~kvfleet.worker.runner.model_config.Rope`
and their application to q and k.

Tables follow transformers' reference: inverse frequencies and angles in fp32, then cast to the
model dtype (so fp32 logits match it to ~1e-5). The half-split layout (``rotate_half``) rotates
the first ``rotary_dim`` dims of each head; the rest pass through (partial rotary).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvfleet.worker.runner.model_config import Rope, RopeScaling


def _llama3_scaling(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths ÷ factor, a smooth ramp in between."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope_scaling(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """LongRoPE within ``original_max_position_embeddings``: frequency ``i`` ÷ ``short_factor[i]``."""
    return inv_freq / torch.tensor(s.short_factor, dtype=torch.float32)


def _yarn_scaling(inv_freq: torch.Tensor, s: RopeScaling, theta: float) -> torch.Tensor:
    """YaRN: frequencies that turn more than ``beta_fast`` times over the original context
    stay, those under ``beta_slow`` turns are ÷ ``factor``, a linear ramp over the dims between."""
    dim = 2 * inv_freq.numel()

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: ÷ factor (interpolation)
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


_ROPE_SCALING: dict[str, Callable[[torch.Tensor, RopeScaling], torch.Tensor]] = {
    "linear": lambda inv_freq, s: inv_freq / s.factor,
    "llama3": _llama3_scaling,
    "longrope": _longrope_scaling,
}


def rope_tables(rope: Rope, max_positions: int, dtype: torch.dtype, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(max_positions, rope.rotary_dim)``, computed in fp32, cast to dtype."""
    dim = rope.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    attention_factor = 1.0
    if rope.scaling is not None and rope.scaling.rope_type == "yarn":
        inv_freq = _yarn_scaling(inv_freq, rope.scaling, rope.theta)
        attention_factor = rope.scaling.attention_factor
    elif rope.scaling is not None:
        inv_freq = _ROPE_SCALING[rope.scaling.rope_type](inv_freq, rope.scaling)
        attention_factor = rope.scaling.attention_factor
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def stacked_rope_tables(ropes: tuple[Rope, ...], max_positions: int, dtype: torch.dtype,
                        device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(len(ropes), max_positions, rotary_dim)``: one table per rope
    (every rope of a model rotates the same number of dims)."""
    tables = [rope_tables(r, max_positions, dtype, device) for r in ropes]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)`` by ``cos``/``sin`` ``(T, 1, rotary_dim)``
    (half-split layout); dims past ``rotary_dim`` pass through unchanged."""
    rotary = cos.shape[-1]
    if rotary != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
