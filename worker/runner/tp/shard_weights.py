"""Read one tensor-parallel rank's slices of a checkpoint, never the whole model.

Column-parallel (split along the output, HF's dim 0): ``q_proj``, ``k_proj``, ``v_proj`` with
their biases (each rank's fused QKV shard is then ``[q_r | k_r | v_r]``, not one contiguous
slice of a fused matrix), ``gate_proj``, ``up_proj``. Row-parallel (split along the input,
dim 1): ``o_proj``, ``down_proj``; their partial outputs are summed by one all-reduce each. A
row-parallel bias is kept whole by rank 0 and zero elsewhere, so the sum adds it once.

Replicated: norms and the embedding table (every rank needs the whole hidden state). The LM head
is **not sharded but held by rank 0 alone**: only rank 0 samples, so the other ranks never
compute logits and need no head at all. A vocab-parallel head would split that matmul over
the ranks but add a gather of ``(N, vocab)`` logits to rank 0 every step. Measured by
``bench/tp_bench.py`` on the 2-core CI machine (docs/history/tp_benchmark.md): the head is 7–18 % of
rank 0's tp=2 decode step on a 32k-vocab Llama (hidden 1024) and 4–11 % of SmolLM2's at tp=3,
so splitting it would save at most (T-1)/T of that, while one more collective per step costs
~0.15–0.25 ms on gloo plus the wait for the slowest rank — which is most of what collectives
cost there. Holding it on rank 0 keeps the logits bit-identical in layout to tp=1; revisit it
where collectives are cheap (the shared-memory all-reduce, NCCL).

Each tensor comes from ``safe_open(...).get_slice``, which reads only the requested rows or
columns from the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kvfleet.worker.runner.tp.layout import ShardLayout
from kvfleet.worker.runner.weights import load_weights

_ATTN, _MLP = "self_attn.", "mlp."
# suffix → (axis, which slice); anything not listed is replicated.
_SPLITS: dict[str, tuple[int, str]] = {
    _ATTN + "q_proj.weight": (0, "q"), _ATTN + "q_proj.bias": (0, "q"),
    _ATTN + "k_proj.weight": (0, "kv"), _ATTN + "k_proj.bias": (0, "kv"),
    _ATTN + "v_proj.weight": (0, "kv"), _ATTN + "v_proj.bias": (0, "kv"),
    _ATTN + "o_proj.weight": (1, "q"),
    _MLP + "gate_proj.weight": (0, "ffn"), _MLP + "up_proj.weight": (0, "ffn"),
    _MLP + "down_proj.weight": (1, "ffn"),
}
_ROW_PARALLEL_BIASES = (_ATTN + "o_proj.bias", _MLP + "down_proj.bias")


def _span(layout: ShardLayout, which: str) -> tuple[int, int]:
    """``[start, stop)`` in elements of the split dimension."""
    d = layout.head_dim
    heads = {"q": layout.q_heads, "kv": layout.kv_heads}.get(which)
    if heads is not None:
        return heads.start * d, heads.stop * d
    cols = layout.ffn_columns
    return cols.start, cols.stop


def load_shard_weights(model_dir: str | Path, layout: ShardLayout,
                       dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This rank's tensors by HF name, sliced per the module docstring (CPU tensors, cast to
    ``dtype`` when given). Ranks other than 0 get no ``lm_head.weight``.

    Raises:
        FileNotFoundError: see :func:`kvfleet.worker.runner.weights.weight_files`.
        ValueError: a tensor name appears in two shards, or a split dimension is not the
            size the layout expects (config.json and weights disagree).
    """
    def read(f, name: str) -> torch.Tensor | None:
        if name == "lm_head.weight" and layout.rank != 0:
            return None
        return _read(f, name, layout)

    return load_weights(model_dir, dtype, read)


def _read(f, name: str, layout: ShardLayout) -> torch.Tensor:
    suffix = name.split(".layers.", 1)[-1].split(".", 1)[-1] if ".layers." in name else name
    if suffix in _ROW_PARALLEL_BIASES:
        t = f.get_tensor(name)
        return t if layout.rank == 0 else torch.zeros_like(t)
    split = _SPLITS.get(suffix)
    if split is None:
        return f.get_tensor(name)
    axis, which = split
    start, stop = _span(layout, which)
    sl = f.get_slice(name)
    size = sl.get_shape()[axis]
    total = {"q": layout.num_heads * layout.head_dim, "kv": layout.num_kv_heads * layout.head_dim,
             "ffn": layout.intermediate_size}[which]
    if size != total:
        raise ValueError(f"{name}: dimension {axis} is {size}, config.json implies {total}")
    return sl[start:stop] if axis == 0 else sl[:, start:stop]
