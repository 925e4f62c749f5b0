"""kvfleet's paged attention as a transformers attention function (``kvfleet_paged``).

A Hugging Face attention layer computes q/k/v, its norms and RoPE (at the positions the
runner passes as ``position_ids``), then calls the registered function with
``(module, query, key, value, attention_mask, scaling=…, **kwargs)``. The runner's forward
kwargs reach it unchanged: ``kvfleet_meta`` (the step's
:class:`~kvfleet.worker.runner.attention.AttentionMetadata`: positions, slot mapping, block
tables) and ``kvfleet_cache`` (the :class:`~kvfleet.worker.runner.kv_cache.KVCache`). The
function writes the new K/V at their slots and attends each query to its own request's keys,
exactly as a native layer does; the mask transformers would build is never built
(:func:`no_mask`): the metadata holds each chunk's offset causal (and windowed) mask.
"""

from __future__ import annotations

import torch

from kvfleet.worker.runner.attention import paged_attention

NAME = "kvfleet_paged"


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs
                            ) -> tuple[torch.Tensor, None]:
    """``query`` ``(1, heads, T, head_dim)``, ``key``/``value`` ``(1, kv_heads, T, head_dim)``
    (RoPE applied; the step's ``T`` tokens flattened into one row) → ``(1, T, heads,
    head_dim)`` and no weights. ``module.layer_idx`` picks the layer's cache and window.

    Raises:
        ValueError: called without the runner's metadata, asked for what the paged kernels
            do not compute (attention soft-capping, attention sinks, dropout), or for a
            sliding window other than the one the step's masks were built for.
    """
    meta, cache = kwargs.get("kvfleet_meta"), kwargs.get("kvfleet_cache")
    if meta is None or cache is None:
        raise ValueError(f"{NAME}: called outside kvfleet's model runner (no kvfleet_meta)")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{NAME}: {name} is not supported by the paged attention")
    if dropout:
        raise ValueError(f"{NAME}: attention dropout is a training feature")
    layer = module.layer_idx
    window = kwargs["kvfleet_windows"][layer]
    if kwargs.get("sliding_window") not in (None, window):  # the step's masks are built for ours
        raise ValueError(f"{NAME}: layer {layer} asks for a window of {kwargs['sliding_window']} "
                         f"tokens, config.json's reading gives {window}")
    key_cache, value_cache = cache.layer(layer)
    q = query[0].transpose(0, 1).contiguous()  # (T, heads, head_dim)
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = paged_attention(q, k, v, key_cache, value_cache, meta, window, scaling)
    return out.view(1, q.shape[0], q.shape[1], q.shape[2]), None


def no_mask(*args, **kwargs) -> None:
    """The mask builder registered beside :func:`paged_attention_forward`: no dense mask."""
    return None


def register() -> str:
    """Register :func:`paged_attention_forward` and :func:`no_mask` under :data:`NAME` in
    transformers' interfaces (idempotent); returns the name to set as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, no_mask)
    return NAME
