"""HuggingFace checkpoint tensors → the Llama-family decoder's state dict.

Q/K/V and gate/up are fused (``[in, out]``, columns q | k | v and gate | up); a checkpoint that
stores them fused already (Phi-3's ``qkv_proj`` / ``gate_up_proj``, sliced per rank by
:mod:`kvfleet.worker.runner.tp.shard_weights`) is taken as it is. Norm names follow the
family's layout: Llama's ``post_attention_layernorm`` is the norm *before* the MLP, Gemma's
(with four norms a layer) the one on the attention output.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvfleet.worker.runner.model_config import ModelConfig

# Checkpoint tensors that carry no weights (older exports store RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# state-dict norm → checkpoint norm, without / with sandwich norms (four a layer).
_NORMS = {
    False: {"input_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    True: {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
           "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"},
}


class _Source:
    """The checkpoint's tensors, each taken once; what is left over is reported."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.arch = config.architecture
        self.src = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
        if config.tie_word_embeddings:
            self.src.pop("lm_head.weight", None)  # some exports store the tied copy too

    def take(self, *names: str) -> torch.Tensor:
        missing = [n for n in names if n not in self.src]
        if missing:
            raise KeyError(f"{self.arch} checkpoint lacks tensor(s): {', '.join(missing)}")
        return torch.cat([self.src.pop(n) for n in names]) if len(names) > 1 else self.src.pop(names[0])

    def take_t(self, *names: str) -> torch.Tensor:  # HF [out, in] → [in, out]
        return self.take(*names).t().contiguous()

    def take_fused_t(self, fused: str, *names: str) -> torch.Tensor:
        """``fused`` where the checkpoint stores it, else ``names`` concatenated; ``[in, out]``."""
        return self.take_t(fused) if fused in self.src else self.take_t(*names)

    def check_consumed(self) -> None:
        if self.src:
            names = ", ".join(sorted(self.src)[:5])
            raise ValueError(f"{len(self.src)} checkpoint tensors unused by {self.arch}: {names}")


def _qk_norm(config: ModelConfig, src: _Source, attn: str) -> torch.Tensor:
    """q's and k's per-head norm weights ``(head_dim,)`` stacked per head ``(heads + kv_heads,
    head_dim)`` (this rank's heads), so one norm call covers both."""
    q, k = src.take(attn + "q_norm.weight"), src.take(attn + "k_norm.weight")
    return torch.cat([q.expand(config.num_heads, -1), k.expand(config.num_kv_heads, -1)])


# Per-expert checkpoint modules: (gate, up, down) names.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _stack_t(src: _Source, names: list[str]) -> torch.Tensor:
    return torch.stack([src.take_t(n) for n in names])


def _moe_tensors(config: ModelConfig, src: _Source, theirs: str, ours: str) -> dict[str, torch.Tensor]:
    """A sparse block's tensors (:class:`~.moe.SparseMoE`): the router ``[hidden, E]``, and the
    experts stacked, ``[in, out]`` each, gate | up fused. Per-expert modules
    (``experts.{e}.gate_proj`` / Mixtral's ``w1``, ``w3``, ``w2``), or gpt-oss's stacked
    ``experts.gate_up_proj`` ``[E, in, 2I]`` whose gate and up columns interleave (de-interleaved
    here) with its biases; MXFP4 blocks are dequantized before this (:mod:`.mxfp4`)."""
    moe = config.moe
    assert moe is not None
    e = moe.num_experts
    router = theirs + ("router." if moe.bias else "gate.")
    out = {ours + "router_weight": src.take_t(router + "weight")}
    if moe.bias:
        out[ours + "router_bias"] = src.take(router + "bias")
    ex = theirs + "experts."
    if ex + "gate_up_proj" in src.src:
        gate_up = src.take(ex + "gate_up_proj")
        out[ours + "gate_up"] = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).contiguous()
        out[ours + "down"] = src.take(ex + "down_proj")
        if moe.bias:
            b = src.take(ex + "gate_up_proj_bias")
            out[ours + "gate_up_bias"] = torch.cat([b[..., ::2], b[..., 1::2]], dim=-1).contiguous()
            out[ours + "down_bias"] = src.take(ex + "down_proj_bias")
        return out
    gate, up, down = next((n for n in _EXPERT_NAMES if f"{ex}0.{n[0]}.weight" in src.src),
                          _EXPERT_NAMES[0])
    out[ours + "gate_up"] = torch.cat([_stack_t(src, [f"{ex}{i}.{gate}.weight" for i in range(e)]),
                                       _stack_t(src, [f"{ex}{i}.{up}.weight" for i in range(e)])],
                                      dim=-1)
    out[ours + "down"] = _stack_t(src, [f"{ex}{i}.{down}.weight" for i in range(e)])
    return out


def mlp_tensors(config: ModelConfig, src: _Source, layer: int, theirs: str, ours: str
                ) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s MLP slot tensors (:func:`~.mlp.mlp_for_layer`), from checkpoint prefix
    ``theirs`` (``model.layers.{i}.mlp.``) to state-dict prefix ``ours``: the dense gated MLP's
    gate|up (fused) and down, ``[in, out]``; a sparse layer's block (:func:`_moe_tensors`),
    read from the family's module (``block_sparse_moe.`` for Mixtral)."""
    moe = config.moe
    if moe is not None and moe.sparse[layer]:
        return _moe_tensors(config, src, theirs.removesuffix("mlp.") + moe.prefix + ".", ours)
    return {ours + "gate_up_weight": src.take_fused_t(
                theirs + "gate_up_proj.weight", theirs + "gate_proj.weight", theirs + "up_proj.weight"),
            ours + "down_weight": src.take_t(theirs + "down_proj.weight")}


def fuse_hf_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                    lm_head: bool = True) -> dict[str, torch.Tensor]:
    """HF tensor names → the decoder's state dict: q|k|v and gate|up fused, matrices
    ``[in, out]`` (``lm_head=False``: no LM head).

    Raises:
        KeyError: a tensor the config requires is missing.
        ValueError: the checkpoint holds tensors this model would silently ignore.
    """
    src = _Source(config, weights)
    embed = src.take("model.embed_tokens.weight")
    out = {"embed_tokens": embed, "norm": src.take("model.norm.weight")}
    if lm_head:
        out["lm_head_weight"] = (embed.t().contiguous() if config.tie_word_embeddings
                                 else src.take_t("lm_head.weight"))
    for i in range(config.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        out[o + "qkv_weight"] = src.take_fused_t(attn + "qkv_proj.weight",
                                                 *(f"{attn}{n}_proj.weight" for n in "qkv"))
        if config.qkv_bias:
            out[o + "qkv_bias"] = src.take(*(f"{attn}{n}_proj.bias" for n in "qkv"))
        out[o + "o_weight"] = src.take_t(attn + "o_proj.weight")
        if config.o_bias:
            out[o + "o_bias"] = src.take(attn + "o_proj.bias")
        if config.style.qk_norm:
            out[o + "qk_norm"] = _qk_norm(config, src, attn)
        if config.style.attn_sinks:
            out[o + "sinks"] = src.take(attn + "sinks")
        out.update(mlp_tensors(config, src, i, mlp, o + "mlp."))
        for ours, theirs in _NORMS[config.style.sandwich_norms].items():
            out[o + ours] = src.take(f"{p}{theirs}.weight")
    src.check_consumed()
    return out
