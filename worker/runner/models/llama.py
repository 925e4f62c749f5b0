"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, and with a sparse
mixture-of-experts MLP slot Qwen3-MoE, Mixtral, gpt-oss): RMSNorm, RoPE, GQA attention (with
per-head sinks for gpt-oss), a gated MLP or experts (:mod:`.moe`).

Differences between the families live in :class:`ModelConfig` (sliding window per layer,
QKV/O bias, RoPE per layer, and its :class:`~kvfleet.worker.runner.model_config.DecoderStyle`:
qk-norm, Gemma's ``1 + w`` norms and four norms a layer, embedding scale, activation,
attention scale, logit soft-capping), as a few switches here rather than one module each. At
load time Q/K/V and gate/up are fused into one matrix each (:mod:`.checkpoint`), so a layer
runs four projections (:data:`~.PROJECTIONS`), each a :class:`Linear` whose weight is packed
once at load for the CPU's GEMM library (see :mod:`.linear`; a tied LM head gets its own packed
copy, the embedding table stays for lookups). Tensor parallelism and LoRA wrap those
projections after the model is built; the model itself is the plain single-device model. The
forward calls torch ops directly (no per-op module dispatch). Numerics follow transformers'
reference (RoPE tables in fp32 then cast, RMSNorm in fp32) so fp32 logits match it to ~1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.worker.runner import layer_ops
from kvfleet.worker.runner.attention import AttentionMetadata, GroupedMetadata, paged_attention
from kvfleet.worker.runner.decode_rows import DecodeRows
from kvfleet.worker.runner.kv_cache import KVCache
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.models.checkpoint import fuse_hf_weights
from kvfleet.worker.runner.models.linear import NoLinear, Projection, projection
from kvfleet.worker.runner.models.mlp import DenseMLP, mlp_for_layer
from kvfleet.worker.runner.models.moe import SparseMoE
from kvfleet.worker.runner.models.rope import apply_rope, stacked_rope_tables
from kvfleet.worker.runner.quant.qlayer import QuantDecodeLayer
from kvfleet.worker.runner.quant.qstack import QuantDecodeStack


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``(..., size)`` normalised over its last dim in fp32 like the reference, cast back,
    then scaled by ``weight`` (``(size,)``, or any shape broadcasting against ``x``)."""
    size = x.shape[-1:]
    if x.dtype == torch.float32:
        if weight.shape == size:
            return F.rms_norm(x, size, weight, eps)
        return F.rms_norm(x, size, eps=eps) * weight
    return weight * F.rms_norm(x.float(), size, eps=eps).to(x.dtype)


def rms_norm_fp32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's order: normalise and scale in fp32, then cast (``weight`` fp32, holding ``1 + w``)."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps)
    return (F.rms_norm(x.float(), x.shape[-1:], eps=eps) * weight).to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    """One block. Loaded as ``[in, out]`` parameters (``qkv_weight`` columns q | k | v), then
    :meth:`pack` turns them into projections; the MLP sits in the ``mlp`` slot (:mod:`.mlp`).

    Norms: ``input_norm`` before attention and ``mlp_norm`` before the MLP; with
    ``sandwich_norms`` also ``attn_out_norm`` / ``mlp_out_norm`` on their outputs; with
    ``qk_norm``, ``qk_norm`` ``(heads + kv_heads, head_dim)``: q's per-head weight repeated
    over the query heads, then k's over the KV heads (one norm call for both). With
    ``attn_sinks``, ``sinks`` ``(heads,)``: each query head's sink logit."""

    qkv: Projection
    o: Projection
    PROJECTIONS = ("qkv", "o")

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, q, kv = config.hidden_size, config.q_size, config.kv_size
        style = config.style
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = config.sliding_windows[layer_idx]
        self.rope_index = config.rope_index(layer_idx)
        self.scale = style.attn_scale if style.attn_scale is not None else self.head_dim ** -0.5
        self.norm = rms_norm_fp32_scale if style.norm_offset else rms_norm
        self.input_norm = _weight(h)
        self.qkv_weight = _weight(h, q + 2 * kv)
        self.qkv_bias = _weight(q + 2 * kv) if config.qkv_bias else None
        self.o_weight = _weight(q, h)
        self.o_bias = _weight(h) if config.o_bias else None
        self.qk_norm = (_weight(self.num_heads + self.num_kv_heads, self.head_dim)
                        if style.qk_norm else None)
        self.sinks = _weight(self.num_heads) if style.attn_sinks else None
        self.attn_out_norm = _weight(h) if style.sandwich_norms else None
        self.mlp_norm = _weight(h)
        self.mlp_out_norm = _weight(h) if style.sandwich_norms else None
        self.mlp: Any = mlp_for_layer(config, layer_idx)
        # see _decode_layer: a shape the one-call decode layer takes, then its binding
        self._decode_shape = (not style.qk_norm and not style.sandwich_norms
                              and isinstance(self.mlp, DenseMLP) and self.mlp.silu)
        self._decode_call: QuantDecodeLayer | None = None

    def pack(self, one_row_copy: bool = False) -> None:
        """Replace the loaded matrices by projections (:func:`~.linear.projection`;
        ``one_row_copy``: see :class:`~.linear.Linear`)."""
        for name in self.PROJECTIONS:
            weight, bias = f"{name}_weight", f"{name}_bias"
            setattr(self, name, projection(getattr(self, weight), getattr(self, bias), one_row_copy))
            delattr(self, weight)
            delattr(self, bias)
        self.mlp.pack(one_row_copy)

    def projection_holders(self) -> dict[str, Any]:
        """Projection name (:data:`~.PROJECTIONS`) → the object holding it as an attribute."""
        return {**{n: self for n in self.PROJECTIONS}, **{n: self.mlp for n in self.mlp.PROJECTIONS}}

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata, key_cache: torch.Tensor,
                value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``hidden + delta`` (``delta`` None: ``hidden``), each
        ``(T, hidden_size)``, through this layer; writes this layer's K/V. ``cos``/``sin``:
        ``(T, 1, rotary_dim)``, this layer's rope rows. With a ``delta``, ``hidden`` must be
        a tensor a layer returned: the sum may be written over it.

        Returns:
            The stream after the layer in the same form, ``(hidden, delta)``: its last residual
            add is left to the next layer's input norm, which fuses it (as vLLM's
            ``fused_add_rms_norm``), or to :func:`settle`. ``hidden`` is a tensor of the
            layer's own, which the caller may add to in place.
        """
        call = self._decode_call
        if call is not None and call.runs:  # bound: fp32 activations on CPU (see _decode_layer)
            rows = meta.decode_rows
            if rows is not None and call.current(self.qkv, self.o):
                return call(hidden, delta, cos, sin, rows, self.window, key_cache, value_cache)
        if self.qk_norm is None and layer_ops.applies(hidden):
            return self._forward_fused(hidden, delta, cos, sin, meta, key_cache, value_cache)
        if delta is not None:
            hidden = hidden + delta
        t = hidden.shape[0]
        x = self.norm(hidden, self.input_norm, self.eps)
        qkv = self.qkv(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : heads * self.head_dim].view(t, heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.norm(qk, self.qk_norm, self.eps)
        # RoPE on Q and K together: one kernel for both.
        qk = apply_rope(qk, cos, sin)
        v = qkv[:, heads * self.head_dim :].view(t, self.num_kv_heads, self.head_dim)
        attn = self.o(paged_attention(qk[:, : self.num_heads], qk[:, self.num_heads :], v,
                                      key_cache, value_cache, meta, self.window, self.scale,
                                      self.sinks))
        if self.attn_out_norm is not None:
            attn = self.norm(attn, self.attn_out_norm, self.eps)
        hidden = hidden + attn
        out = self.mlp.forward(self.norm(hidden, self.mlp_norm, self.eps))
        if self.mlp_out_norm is not None:
            out = self.norm(out, self.mlp_out_norm, self.eps)
        return hidden, out

    def _forward_fused(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                       cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       key_cache: torch.Tensor, value_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with the small ops between projections in C (:mod:`.layer_ops`;
        fp32 on CPU, no qk-norm): residual add with norm (twice), RoPE with the K/V write."""
        rows = meta.decode_rows
        if rows is not None:
            call = self._decode_layer()
            if call is not None:
                return call(hidden, delta, cos, sin, rows, self.window, key_cache, value_cache)
        hd, kv = self.head_dim, self.num_kv_heads
        # in place: with a delta, hidden is a previous layer's own tensor (see forward)
        hidden, x = layer_ops.add_rms_norm(hidden, delta, self.input_norm, self.eps, in_place=True)
        qkv = self.qkv(x)
        layer_ops.rope_write_kv(qkv, cos, sin, self.num_heads, kv, hd, key_cache, value_cache,
                                meta.slot_mapping)
        # q | k | v as views by one split (per-part slicing costs several torch calls a layer)
        q, k, v = qkv.view(hidden.shape[0], self.num_heads + 2 * kv, hd).split_with_sizes(
            (self.num_heads, kv, kv), 1)
        attn = self.o(paged_attention(q, k, v, key_cache, value_cache, meta, self.window,
                                      self.scale, self.sinks, kv_written=True))
        if self.attn_out_norm is not None:
            attn = self.norm(attn, self.attn_out_norm, self.eps)
        hidden, x = layer_ops.add_rms_norm(hidden, attn, self.mlp_norm, self.eps)
        out = self.mlp.forward(x)
        if self.mlp_out_norm is not None:
            out = self.norm(out, self.mlp_out_norm, self.eps)
        return hidden, out

    def _decode_layer(self) -> QuantDecodeLayer | None:
        """The whole layer as one C call for decode-only steps (:mod:`~..quant.qlayer`:
        quantized projections, no sandwich norms, a SiLU-gated dense MLP), or None; bound on
        first use and again whenever a projection was replaced (LoRA and tensor parallelism
        wrap them after the model is built)."""
        if not self._decode_shape:
            return None
        call = self._decode_call
        if call is None or not call.current(self.qkv, self.o):
            call = QuantDecodeLayer.bind(self.qkv, self.o, self.mlp, self.input_norm, self.mlp_norm,
                                         self.eps, self.scale, self.num_heads, self.num_kv_heads,
                                         self.head_dim, self.sinks)
            self._decode_call = call
        return call if call.runs else None


def settle(hidden: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """The residual stream ``hidden + delta`` as one tensor (:meth:`LlamaDecoderLayer.forward`'s
    pair; ``hidden`` a layer's own, added to in place: the same sum as the next layer's norm)."""
    return hidden if delta is None else hidden.add_(delta)


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
        self.final_norm = rms_norm_fp32_scale if config.style.norm_offset else rms_norm
        # [in, out]; see pack
        self.lm_head_weight = _weight(config.hidden_size, config.vocab_size) if lm_head else None
        self.rope_cos = self.rope_sin = torch.empty(0)
        self.embed_scale: torch.Tensor | None = None
        self._decode_stack: QuantDecodeStack | None = None  # see _stack

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache) -> torch.Tensor:
        """``input_ids``/``positions`` ``(T,)`` → hidden states ``(T, hidden_size)`` (pre final
        norm)."""
        hidden, cos, sin = self.embed(input_ids, positions)
        return self.run_layers(hidden, cos, sin, meta, kv_cache)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids``/``positions`` ``(T,)`` → ``(hidden (T, hidden_size), cos, sin)``, the
        RoPE rows ``(num_ropes, T, 1, rotary_dim)`` the layers use."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        return hidden, self.rope_cos[:, positions].unsqueeze(2), self.rope_sin[:, positions].unsqueeze(2)

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache, start: int = 0,
                   should_yield: Callable[[], bool] | None = None) -> tuple[torch.Tensor, int]:
        """Decoder layers ``start..`` over ``hidden`` ``(T, hidden_size)``; after each layer but
        the last, stop when ``should_yield()`` is true (layer-level yield).

        Returns:
            ``(hidden, next_layer)``: ``next_layer == num_layers`` when every layer ran, else
            the layer to resume from (the KV of layers before it is written).
        """
        layers = self._decoder_layers()  # a list once a step: ModuleList indexing costs per layer
        last = len(layers) - 1
        if should_yield is None and start <= last:
            found = self._stack(layers, hidden, meta, kv_cache)
            if found is not None:  # every layer one C call: all of them in one
                hidden, stacked_delta = found[0](hidden, cos, sin, found[1], start)
                return settle(hidden, stacked_delta), last + 1
        # Each rope's rows once a step (the layers share them); None until a layer asks.
        ropes: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cos.shape[0]
        delta: torch.Tensor | None = None
        for i in range(start, last + 1):
            layer = layers[i]
            rope = ropes[layer.rope_index]
            if rope is None:
                rope = ropes[layer.rope_index] = (cos[layer.rope_index], sin[layer.rope_index])
            key_cache, value_cache = kv_cache.layer(i)
            hidden, delta = layer.forward(hidden, delta, rope[0], rope[1], meta.layer(i),
                                          key_cache, value_cache)
            if should_yield is not None and i < last and should_yield():
                return settle(hidden, delta), i + 1
        return settle(hidden, delta), last + 1

    def _stack(self, layers: list[LlamaDecoderLayer], hidden: torch.Tensor,
               meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache
               ) -> tuple[QuantDecodeStack, DecodeRows] | None:
        """Every layer as one C call (:mod:`~..quant.qstack`) with the step's decode rows, where
        each layer would take its one-call path (:meth:`LlamaDecoderLayer._decode_layer`) and
        the step is decode-only with one layer group; else None (the per-layer loop). Rebuilt
        when a layer was rebound (LoRA, tensor parallelism) or the cache replaced."""
        if not isinstance(meta, AttentionMetadata):
            return None
        stack, views = self._decode_stack, kv_cache.views()
        if stack is None or stack.caches is not views or not all(
                layer._decode_call is call and call.current(layer.qkv, layer.o)
                for layer, call in zip(layers, stack.calls, strict=True)):
            self._decode_stack = stack = None
            if not layer_ops.applies(hidden):
                return None
            calls = []
            for layer in layers:
                call = layer._decode_layer()
                if call is None:
                    return None
                calls.append(call)
            stack = QuantDecodeStack(calls, views, [layer.rope_index for layer in layers],
                                     [layer.window for layer in layers])
            self._decode_stack = stack
        rows = meta.decode_rows
        return None if rows is None else (stack, rows)

    def pack(self, one_row_copy: bool = False) -> None:
        """Turn every loaded matrix into a projection (:func:`~.linear.projection`: packed
        where the platform allows; ``one_row_copy``: also a copy for steps of a few rows, see
        :class:`~.linear.Linear`)."""
        for layer in self._decoder_layers():
            layer.pack(one_row_copy)
        head = self.lm_head_weight
        self.lm_head = (projection(head, None, one_row_copy) if head is not None
                        else NoLinear(self.config.vocab_size))
        del self.lm_head_weight

    def projections(self) -> list[Projection]:
        """Every projection: each layer's (see :data:`~.PROJECTIONS`), then the LM head."""
        return [getattr(holder, name) for layer in self._decoder_layers()
                for name, holder in layer.projection_holders().items()] + [self.lm_head]

    def _decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast("list[LlamaDecoderLayer]", list(self.layers))

    def weight_bytes_per_decode(self) -> int:
        """Bytes of weights one decode step reads: everything but the embedding table, of
        which it reads one row per token (a tied LM head counts through its own copy), and of
        a sparse block's experts the ``top_k`` one token runs."""
        norms = sum(p.nbytes for name, p in self.named_parameters() if name != "embed_tokens")
        for layer in self._decoder_layers():
            if isinstance(layer.mlp, SparseMoE):
                held = layer.mlp.expert_bytes()
                norms -= held - held * layer.mlp.top_k // layer.mlp.num_experts
        return norms + sum(p.nbytes for p in self.projections())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, hidden_size)`` → ``(N, vocab_size)`` in the model dtype (soft-capped where the
        family says so)."""
        eps = self.config.rms_norm_eps
        if (self.final_norm is rms_norm and hidden.dim() == 2 and hidden.stride(1) == 1
                and layer_ops.applies(hidden)):
            normed = layer_ops.add_rms_norm(hidden, None, self.norm, eps)[1]  # as the layers' norms
        else:
            normed = self.final_norm(hidden, self.norm, eps)
        logits = self.lm_head(normed)
        cap = self.config.style.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                dtype: torch.dtype, device: torch.device | str,
                one_row_copy: bool = False, lm_head: bool = True) -> LlamaForCausalLM:
    """Build on the meta device (no throwaway init), then take the fused checkpoint tensors
    (``one_row_copy``: see :class:`Linear`; ``lm_head``: see :func:`.checkpoint.fuse_hf_weights`).
    Gemma-style norm weights are held as ``1 + w`` in fp32 (see :func:`rms_norm_fp32_scale`)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, lm_head)
    state = {k: v.to(device=device, dtype=dtype)
             for k, v in fuse_hf_weights(config, weights, lm_head).items()}
    if config.style.norm_offset:
        state = {k: 1.0 + v.float() if _is_norm(k) else v for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    for param in model.parameters():
        param.requires_grad_(False)
    model.rope_cos, model.rope_sin = stacked_rope_tables(
        config.ropes, config.max_position_embeddings, dtype, device)
    if config.style.embed_scale:  # as transformers: sqrt(hidden_size) rounded to the dtype
        model.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(device=device, dtype=dtype)
    model.pack(one_row_copy)
    return model.eval()


def _is_norm(name: str) -> bool:
    return name == "norm" or name.rsplit(".", 1)[-1].endswith("norm")
