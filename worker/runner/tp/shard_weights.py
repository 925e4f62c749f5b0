"""Read one tensor-parallel rank's slices of a checkpoint, never the whole model.

Column-parallel (split along the output, HF's dim 0): ``q_proj``, ``k_proj``, ``v_proj`` with
their biases (each rank's fused QKV shard is then ``[q_r | k_r | v_r]``, not one contiguous
slice of a fused matrix), ``gate_proj``, ``up_proj``. Row-parallel (split along the input,
dim 1): ``o_proj``, ``down_proj``; their partial outputs are summed by one all-reduce each. A
row-parallel bias is kept whole by rank 0 and zero elsewhere, so the sum adds it once.

Experts (:data:`~kvfleet.worker.runner.tp.layout.EXPERT_SPLITS`, gpt-oss's stacked tensors):
each rank reads its slice of every expert's intermediate dimension, gate/up by column and down
by row, like a dense MLP (:func:`_read_expert`). Attention sinks follow their query heads.

Replicated: norms, routers and the embedding table (every rank needs the whole hidden state). The LM head
is **not sharded but held by rank 0 alone**: only rank 0 samples, so the other ranks never
compute logits and need no head at all. A vocab-parallel head would split that matmul over the
ranks but add a gather of ``(N, vocab)`` logits to rank 0 every step: one more collective and
one more wait for the slowest rank, which is most of what collectives cost on gloo, against a
head that is a small share of rank 0's step (``bench/engine/tp_bench.py`` measures both). Holding it
on rank 0 keeps the logits bit-identical in layout to tp=1; revisit it where collectives are
cheap (the shared-memory all-reduce, NCCL).

Each projection splits per :data:`~kvfleet.worker.runner.tp.layout.SPLITS`; each tensor comes
from ``safe_open(...).get_slice``, which reads only the requested rows or columns from the file.
A fused checkpoint module (:data:`~kvfleet.worker.runner.tp.layout.FUSED`, Phi-3's
``qkv_proj``) is read as this rank's span of each member, concatenated in member order: the
same ``[q_r | k_r | v_r]`` a rank builds from separate modules.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvfleet.worker.runner.mxfp4 import dequantize_checkpoint
from kvfleet.worker.runner.tp.layout import EXPERT_SPLITS, FUSED, ROW, SPLITS, ShardLayout
from kvfleet.worker.runner.weights import load_weights


def load_shard_weights(model_dir: str | Path, layout: ShardLayout,
                       dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This rank's tensors by HF name, sliced per the module docstring (CPU tensors, cast to
    ``dtype`` when given). Ranks other than 0 get no ``lm_head.weight``; at tp=1 the one rank's
    share is the whole checkpoint, read as is.

    Raises:
        FileNotFoundError: see :func:`kvfleet.worker.runner.weights.weight_files`.
        ValueError: a tensor name appears in two shards, or a split dimension is not the
            size the layout expects (config.json and weights disagree).
    """
    def read(f, name: str) -> torch.Tensor | None:
        if name == "lm_head.weight" and not layout.holds_lm_head:
            return None
        return _read(f, name, layout)

    weights = load_weights(model_dir, dtype, read if layout.tp > 1 else None)
    return dequantize_checkpoint(weights, dtype, lambda name, t: shard_tensor(name, t, layout))


class _InMemory:
    """One tensor behind the two accessors :func:`_read` uses (a safetensors file's
    ``get_tensor`` / ``get_slice``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensor

    def get_slice(self, name: str) -> _InMemory:
        return self

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def shard_tensor(name: str, tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's share of HF tensor ``name`` already in memory, by the rule the loader
    applies to the checkpoint's (the module docstring); the tensor itself at tp=1.

    Raises:
        ValueError: a split dimension that is not the size the layout expects.
    """
    return tensor if layout.tp == 1 else _read(_InMemory(tensor), name, layout)


def _read(f, name: str, layout: ShardLayout) -> torch.Tensor:
    # "model.layers.{i}.self_attn.q_proj.weight" → module "q_proj", kind "weight"
    module, kind = name.split(".")[-2:] if ".layers." in name else ("", "")
    if ".experts." in name:
        return _read_expert(f, name, layout)
    if kind == "sinks":  # one per query head
        return f.get_slice(name)[layout.q_heads.start:layout.q_heads.stop]
    if module in FUSED and kind in ("weight", "bias"):
        return _read_fused(f, name, FUSED[module], layout)
    split = SPLITS.get(module) if kind in ("weight", "bias") else None
    if split is None:
        return f.get_tensor(name)
    if kind == "bias" and split.axis == ROW:  # added once, by rank 0, to the summed output
        t = f.get_tensor(name)
        return t if layout.rank == 0 else torch.zeros_like(t)
    axis = split.axis if kind == "weight" else 0
    span, total = layout.span(split.part), layout.full_size(split.part)
    sl = f.get_slice(name)
    size = sl.get_shape()[axis]
    if size != total:
        raise ValueError(f"{name}: dimension {axis} is {size}, config.json implies {total}")
    return sl[span.start:span.stop] if axis == 0 else sl[:, span.start:span.stop]


def _read_expert(f, name: str, layout: ShardLayout) -> torch.Tensor:
    """This rank's slice of an expert tensor along the expert's intermediate dimension:
    per-expert ``[out, in]`` weights by :data:`~.layout.EXPERT_SPLITS`; gpt-oss's stacked
    ``gate_up_proj`` ``[E, in, 2I]`` (gate and up columns interleaved, so a contiguous span
    ``2s .. 2e``) and its bias, ``down_proj`` ``[E, I, out]``; a row-parallel bias whole on rank
    0, zero elsewhere. MXFP4 blocks and scales are read whole, dequantized, then sliced
    (:func:`load_shard_weights`)."""
    parts = name.split(".")
    kind = parts[-1]
    if kind.endswith(("_blocks", "_scales")):
        return f.get_tensor(name)
    if kind == "down_proj_bias":
        t = f.get_tensor(name)
        return t if layout.rank == 0 else torch.zeros_like(t)
    span, total = layout.expert_columns, layout.expert_intermediate_size
    sl = f.get_slice(name)
    shape = sl.get_shape()
    if kind == "weight" and parts[-2] in EXPERT_SPLITS:
        axis = EXPERT_SPLITS[parts[-2]]
    elif kind in ("gate_up_proj", "gate_up_proj_bias"):
        axis, span, total = len(shape) - 1, range(2 * span.start, 2 * span.stop), 2 * total
    elif kind == "down_proj":
        axis = 1
    else:
        return f.get_tensor(name)
    if shape[axis] != total:
        raise ValueError(f"{name}: dimension {axis} is {shape[axis]}, config.json implies {total}")
    index = [slice(None)] * len(shape)
    index[axis] = slice(span.start, span.stop)
    return sl[tuple(index)]


def _read_fused(f, name: str, members: tuple[str, ...], layout: ShardLayout) -> torch.Tensor:
    """This rank's rows of each member of a fused column-parallel tensor, in member order."""
    parts = [SPLITS[m].part for m in members]
    assert all(SPLITS[m].axis != ROW for m in members), "only column-parallel modules fuse"
    sl = f.get_slice(name)
    size, total = sl.get_shape()[0], sum(layout.full_size(p) for p in parts)
    if size != total:
        raise ValueError(f"{name}: dimension 0 is {size}, config.json implies {total}")
    rows, offset = [], 0
    for part in parts:
        span = layout.span(part)
        rows.append(sl[offset + span.start:offset + span.stop])
        offset += layout.full_size(part)
    return torch.cat(rows)
