"""Bytes of LoRA adapter slots, from a model's ``config.json`` (torch-free, like kv_bytes).

One slot holds, for every layer and each of the seven projections a Llama-family adapter may
target (q, k, v, o, gate, up, down), ``A`` ``[in, r]`` and ``B`` ``[r, out]``: at rank ``r``
that is ``r * (in + out)`` elements each. A slot is sized for ``--max-lora-rank`` with every
projection targeted, the most any accepted adapter needs. Per tensor-parallel rank (the rule
of ``worker/runner/lora/adapter.py``): a column-parallel projection (q, k, v, gate, up) holds
``in + out / tp`` per rank, a row-parallel one (o, down) ``in / tp + out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from kvfleet.allocator.model_spec import _head_dim, _positive_int, load_config


def lora_slot_bytes(source: str | Path | Mapping[str, Any], max_rank: int, dtype_bytes: int,
                    tp: int = 1) -> tuple[int, int]:
    """``(bytes, bytes per rank)`` of one adapter slot at ``max_rank``.

    Raises:
        ConfigError: a field the sizes need is missing (the message names it).
        ValueError: ``max_rank``, ``dtype_bytes`` or ``tp`` is not positive.
    """
    for value, name in ((max_rank, "--max-lora-rank"), (dtype_bytes, "dtype bytes"), (tp, "--tp")):
        if value <= 0:
            raise ValueError(f"{name}: must be positive, got {value}")
    cfg = load_config(source)
    layers = _positive_int(cfg, "num_hidden_layers", "n_layer")
    heads = _positive_int(cfg, "num_attention_heads", "n_head")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = _positive_int(cfg, "hidden_size", "n_embd")
    ffn = _positive_int(cfg, "intermediate_size")
    d = _head_dim(cfg, heads)
    q, kv = heads * d, kv_heads * d
    column = [(hidden, q), (hidden, kv), (hidden, kv), (hidden, ffn), (hidden, ffn)]
    row = [(q, hidden), (ffn, hidden)]
    whole = sum(i + o for i, o in column + row)
    per_rank = sum(i + o / tp for i, o in column) + sum(i / tp + o for i, o in row)
    scale = layers * max_rank * dtype_bytes
    return whole * scale, int(round(per_rank * scale))
