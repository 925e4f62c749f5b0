"""Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Differences between the families live in :class:`ModelConfig` (sliding window per layer,
QKV/O bias, RoPE scaling), not in branches here. At load time Q/K/V and gate/up are fused
into one matrix each, so a layer runs four projections (:data:`~.PROJECTIONS`), each a
:class:`Linear` whose weight is packed once at load for the CPU's GEMM library (see
:mod:`.linear`; a tied LM head gets its own packed copy, the embedding table stays for lookups).
Tensor parallelism and LoRA wrap those projections after the model is built; the model itself
is the plain single-device model. The forward calls torch ops directly (no per-op module
dispatch). Numerics follow transformers' reference (RoPE tables in fp32 then
cast, RMSNorm in fp32) so fp32 logits match it to ~1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.worker.runner.attention import AttentionMetadata, paged_attention
from kvfleet.worker.runner.kv_cache import KVCache
from kvfleet.worker.runner.model_config import ModelConfig, RopeScaling
from kvfleet.worker.runner.models import PROJECTIONS
from kvfleet.worker.runner.models.linear import NoLinear, Projection, projection


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


_ROPE_SCALING: dict[str, Callable[[torch.Tensor, RopeScaling], torch.Tensor]] = {
    "linear": lambda inv_freq, s: inv_freq / s.factor,
    "llama3": _llama3_scaling,
}


def rope_tables(config: ModelConfig, dtype: torch.dtype, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(max_position_embeddings, head_dim)``, computed in fp32, cast to dtype."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _ROPE_SCALING[config.rope_scaling.rope_type](inv_freq, config.rope_scaling)
    freqs = torch.arange(config.max_position_embeddings).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)`` by ``cos``/``sin`` ``(T, 1, head_dim)`` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``(T, size)``, normalised in fp32 like the reference, then scaled."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    """One block. Loaded as ``[in, out]`` parameters (``qkv_weight`` columns q | k | v,
    ``gate_up_weight`` columns gate | up), then :meth:`pack` turns them into projections."""

    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, q, kv, ffn = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = config.sliding_windows[layer_idx]
        self.input_norm = _weight(h)
        self.qkv_weight = _weight(h, q + 2 * kv)
        self.qkv_bias = _weight(q + 2 * kv) if config.qkv_bias else None
        self.o_weight = _weight(q, h)
        self.o_bias = _weight(h) if config.o_bias else None
        self.post_norm = _weight(h)
        self.gate_up_weight = _weight(h, 2 * ffn)
        self.down_weight = _weight(ffn, h)
        self.gate_up_bias = self.down_bias = None  # the MLP has none

    def pack(self, one_row_copy: bool = False) -> None:
        """Replace the loaded matrices by projections (:func:`~.linear.projection`;
        ``one_row_copy``: see :class:`~.linear.Linear`)."""
        for name in PROJECTIONS:
            weight, bias = f"{name}_weight", f"{name}_bias"
            setattr(self, name, projection(getattr(self, weight), getattr(self, bias), one_row_copy))
            delattr(self, weight)
            delattr(self, bias)

    def projections(self) -> list[Projection]:
        """The layer's projections, in :data:`~.PROJECTIONS` order."""
        return [getattr(self, name) for name in PROJECTIONS]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, key_cache: torch.Tensor, value_cache: torch.Tensor
                ) -> torch.Tensor:
        """``hidden`` ``(T, hidden_size)`` → ``(T, hidden_size)``; writes this layer's K/V."""
        t = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = self.qkv(x)
        heads = self.num_heads + self.num_kv_heads
        # RoPE on Q and K together: one kernel for both.
        qk = apply_rope(qkv[:, : heads * self.head_dim].view(t, heads, self.head_dim), cos, sin)
        v = qkv[:, heads * self.head_dim :].view(t, self.num_kv_heads, self.head_dim)
        attn = paged_attention(qk[:, : self.num_heads], qk[:, self.num_heads :], v,
                               key_cache, value_cache, meta, self.window)
        hidden = hidden + self.o(attn)
        x = rms_norm(hidden, self.post_norm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate).mul_(up))


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; see :class:`kvfleet.worker.runner.models.CausalLM`.

    ``lm_head=False``: no head (:meth:`compute_logits` then returns no rows)."""

    lm_head: Projection

    def __init__(self, config: ModelConfig, lm_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = _weight(config.hidden_size)
        # [in, out]; see pack
        self.lm_head_weight = _weight(config.hidden_size, config.vocab_size) if lm_head else None
        self.rope_cos = self.rope_sin = torch.empty(0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """``input_ids``/``positions`` ``(T,)`` → hidden states ``(T, hidden_size)`` (pre final
        norm)."""
        hidden, cos, sin = self.embed(input_ids, positions)
        return self.run_layers(hidden, cos, sin, meta, kv_cache)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids``/``positions`` ``(T,)`` → ``(hidden (T, hidden_size), cos, sin)``, the
        RoPE rows ``(T, 1, head_dim)`` every layer uses."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        return hidden, self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata, kv_cache: KVCache, start: int = 0,
                   should_yield: Callable[[], bool] | None = None) -> tuple[torch.Tensor, int]:
        """Decoder layers ``start..`` over ``hidden`` ``(T, hidden_size)``; after each layer but
        the last, stop when ``should_yield()`` is true (layer-level yield).

        Returns:
            ``(hidden, next_layer)``: ``next_layer == num_layers`` when every layer ran, else
            the layer to resume from (the KV of layers before it is written).
        """
        last = len(self.layers) - 1
        for i in range(start, last + 1):
            key_cache, value_cache = kv_cache.layer(i)
            hidden = self.layers[i].forward(hidden, cos, sin, meta, key_cache, value_cache)
            if should_yield is not None and i < last and should_yield():
                return hidden, i + 1
        return hidden, last + 1

    def pack(self, one_row_copy: bool = False) -> None:
        """Turn every loaded matrix into a projection (:func:`~.linear.projection`: packed
        where the platform allows; ``one_row_copy``: also a copy for batch-1 decode, see
        :class:`~.linear.Linear`)."""
        for layer in self._decoder_layers():
            layer.pack(one_row_copy)
        head = self.lm_head_weight
        self.lm_head = (projection(head, None, one_row_copy) if head is not None
                        else NoLinear(self.config.vocab_size))
        del self.lm_head_weight

    def projections(self) -> list[Projection]:
        """Every projection: each layer's (see :data:`~.PROJECTIONS`), then the LM head."""
        return [p for layer in self._decoder_layers() for p in layer.projections()] + [self.lm_head]

    def _decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast("list[LlamaDecoderLayer]", list(self.layers))

    def weight_bytes_per_decode(self) -> int:
        """Bytes of weights one decode step reads: everything but the embedding table, of
        which it reads one row per token (a tied LM head counts through its own copy)."""
        norms = sum(p.nbytes for name, p in self.named_parameters() if name != "embed_tokens")
        return norms + sum(p.nbytes for p in self.projections())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, hidden_size)`` → ``(N, vocab_size)`` in the model dtype."""
        return self.lm_head(rms_norm(hidden, self.norm, self.config.rms_norm_eps))


# Checkpoint tensors that carry no weights (older exports store RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def fuse_hf_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                    lm_head: bool = True) -> dict[str, torch.Tensor]:
    """HF tensor names → this module's state dict: q|k|v and gate|up fused, matrices ``[in, out]``
    (``lm_head=False``: no LM head).

    Raises:
        KeyError: a tensor the config requires is missing.
        ValueError: the checkpoint holds tensors this model would silently ignore.
    """
    src = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        src.pop("lm_head.weight", None)  # some exports store the tied copy too

    def take(*names: str) -> torch.Tensor:
        missing = [n for n in names if n not in src]
        if missing:
            raise KeyError(f"{config.architecture} checkpoint lacks tensor(s): {', '.join(missing)}")
        return torch.cat([src.pop(n) for n in names]) if len(names) > 1 else src.pop(names[0])

    def take_t(*names: str) -> torch.Tensor:  # HF [out, in] → [in, out]
        return take(*names).t().contiguous()

    embed = take("model.embed_tokens.weight")
    out = {"embed_tokens": embed, "norm": take("model.norm.weight")}
    if lm_head:
        out["lm_head_weight"] = (embed.t().contiguous() if config.tie_word_embeddings
                                 else take_t("lm_head.weight"))
    for i in range(config.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        out[o + "qkv_weight"] = take_t(*(f"{attn}{n}_proj.weight" for n in "qkv"))
        if config.qkv_bias:
            out[o + "qkv_bias"] = take(*(f"{attn}{n}_proj.bias" for n in "qkv"))
        out[o + "o_weight"] = take_t(attn + "o_proj.weight")
        if config.o_bias:
            out[o + "o_bias"] = take(attn + "o_proj.bias")
        out[o + "gate_up_weight"] = take_t(mlp + "gate_proj.weight", mlp + "up_proj.weight")
        out[o + "down_weight"] = take_t(mlp + "down_proj.weight")
        out[o + "input_norm"] = take(p + "input_layernorm.weight")
        out[o + "post_norm"] = take(p + "post_attention_layernorm.weight")
    if src:
        names = ", ".join(sorted(src)[:5])
        raise ValueError(f"{len(src)} checkpoint tensors unused by {config.architecture}: {names}")
    return out


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                dtype: torch.dtype, device: torch.device | str,
                one_row_copy: bool = False, lm_head: bool = True) -> LlamaForCausalLM:
    """Build on the meta device (no throwaway init), then take the fused checkpoint tensors
    (``one_row_copy``: see :class:`Linear`; ``lm_head``: see :func:`fuse_hf_weights`)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, lm_head)
    state = {k: v.to(device=device, dtype=dtype)
             for k, v in fuse_hf_weights(config, weights, lm_head).items()}
    model.load_state_dict(state, strict=True, assign=True)
    for param in model.parameters():
        param.requires_grad_(False)
    model.rope_cos, model.rope_sin = rope_tables(config, dtype, device)
    model.pack(one_row_copy)
    return model.eval()
