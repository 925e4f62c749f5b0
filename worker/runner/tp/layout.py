"""Which query heads, KV heads and MLP columns one tensor-parallel rank holds (docs/design.md §3).

Query heads split evenly: rank ``r`` holds heads ``r * H/T .. (r + 1) * H/T - 1``. KV heads
split evenly when ``num_kv_heads % T == 0``; when ``T % num_kv_heads == 0`` every rank holds one
KV head, each replicated ``T / num_kv_heads`` times (rank ``r`` holds head ``r // (T / KV)``,
the one its query heads read). The MLP's intermediate columns split evenly, and so do every
expert's of a mixture-of-experts block (each rank holds its slice of every expert, see
docs/models.md for why not expert parallelism). The embedding, norms and routers are
replicated; the LM head is held by rank 0 alone (see :mod:`.shard_weights` for why).

:data:`SPLITS` is the rule for each projection, read alike by the checkpoint loader
(:mod:`.shard_weights`), the LoRA loader (:mod:`kvfleet.worker.runner.lora.adapter`) and
:func:`kvfleet.worker.runner.tp.linear.parallelize`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvfleet.allocator.kv_bytes import (
    ShardingError,
    head_split_refusal,
    kv_heads_per_rank,
    valid_tp_sizes,
)
from kvfleet.worker.runner.model_config import ModelConfig

COLUMN, ROW = 0, 1  # the HF ``[out, in]`` weight dimension a projection splits along

Part = Literal["q", "kv", "ffn", "expert"]


class Split(NamedTuple):
    """How one projection splits: along ``axis`` (:data:`COLUMN`: its outputs, every rank
    computing its own columns; :data:`ROW`: its inputs, every rank a partial sum), in the
    units of ``part`` (query heads, KV heads or MLP columns)."""

    axis: int
    part: Part


# Projection (HF module name inside a decoder layer) → its split; anything absent is replicated.
SPLITS: dict[str, Split] = {
    "q_proj": Split(COLUMN, "q"), "k_proj": Split(COLUMN, "kv"), "v_proj": Split(COLUMN, "kv"),
    "o_proj": Split(ROW, "q"),
    "gate_proj": Split(COLUMN, "ffn"), "up_proj": Split(COLUMN, "ffn"),
    "down_proj": Split(ROW, "ffn"),
}

# Checkpoint modules storing several column-parallel projections fused along the output, in
# order (Phi-3): a rank reads its span of each member and keeps them in that order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
}

# A per-expert module (``...experts.{e}.<name>.weight``, HF ``[out, in]``) → its split axis
# along the expert's intermediate dimension (Qwen3-MoE's names, Mixtral's w1 / w3 / w2).
EXPERT_SPLITS: dict[str, int] = {"gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW,
                                 "w1": COLUMN, "w3": COLUMN, "w2": ROW}


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank`` of ``tp`` for a model with ``num_heads`` query / ``num_kv_heads`` KV heads.

    Build with :func:`shard_layout`, which validates the split.
    """

    tp: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    expert_intermediate_size: int = 0

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return kv_heads_per_rank(self.num_kv_heads, self.num_heads, self.tp)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 when the heads split)."""
        return max(1, self.tp // self.num_kv_heads)

    @property
    def q_heads(self) -> range:
        """This rank's query heads (global indices)."""
        return range(self.rank * self.local_heads, (self.rank + 1) * self.local_heads)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads (global indices); one head under replication."""
        first = self.rank // self.kv_replicas * self.local_kv_heads
        return range(first, first + self.local_kv_heads)

    @property
    def ffn_columns(self) -> range:
        """This rank's slice of the MLP's intermediate dimension."""
        n = self.intermediate_size // self.tp
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def expert_columns(self) -> range:
        """This rank's slice of every expert's intermediate dimension."""
        n = self.expert_intermediate_size // self.tp
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def holds_lm_head(self) -> bool:
        """Whether this rank holds the LM head and computes logits (rank 0 alone)."""
        return self.rank == 0

    def span(self, part: Part) -> range:
        """This rank's ``[start, stop)``, in elements, of a split dimension of size
        :meth:`full_size` (head ranges times ``head_dim`` for ``q``/``kv``)."""
        if part == "ffn":
            return self.ffn_columns
        if part == "expert":
            return self.expert_columns
        heads = self.q_heads if part == "q" else self.kv_heads
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def full_size(self, part: Part) -> int:
        """The whole model's size, in elements, of a dimension split by ``part``."""
        return {"q": self.num_heads * self.head_dim, "kv": self.num_kv_heads * self.head_dim,
                "ffn": self.intermediate_size, "expert": self.expert_intermediate_size}[part]

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head counts and MLP width: the model code, unchanged,
        built from it holds exactly this rank's shard."""
        moe = config.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.tp)
        return dataclasses.replace(config, num_heads=self.local_heads,
                                   num_kv_heads=self.local_kv_heads,
                                   intermediate_size=self.intermediate_size // self.tp, moe=moe)


def check_tp(config: ModelConfig, tp: int) -> None:
    """Refuse a ``tp`` the model cannot be split over, before anything is started.

    Raises:
        ShardingError: query heads, KV heads, MLP or expert width do not split over ``tp``; the message
            names the rule broken, both head counts and every TP size that would work.
    """
    expert = config.moe.intermediate_size if config.moe is not None else 0
    works = [t for t in valid_tp_sizes(config.num_kv_heads, config.num_heads)
             if config.intermediate_size % t == 0 and expert % t == 0]
    if tp in works:
        return
    sizes = (f"{config.num_heads} query / {config.num_kv_heads} KV heads, "
             f"{config.intermediate_size} MLP columns"
             + (f", {expert} columns per expert" if expert else "")
             + f"; tp sizes that work: {', '.join(map(str, works))}")
    field, reason = head_split_refusal(config.num_kv_heads, config.num_heads, tp) or (
        ("intermediate_size", f"{config.intermediate_size} MLP columns do not split over tp={tp}")
        if config.intermediate_size % tp else
        ("moe_intermediate_size" if config.model_type == "qwen3_moe" else "intermediate_size",
         f"{expert} columns per expert do not split over tp={tp}"))
    raise ShardingError(field, f"{reason} ({sizes})")


def shard_layout(config: ModelConfig, tp: int, rank: int) -> ShardLayout:
    """The layout of ``rank`` (0-based) of ``tp``.

    Raises:
        ShardingError: see :func:`check_tp`.
        ValueError: ``rank`` outside ``[0, tp)``.
    """
    check_tp(config, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must lie in [0, {tp}), got {rank}")
    return ShardLayout(tp, rank, config.num_heads, config.num_kv_heads, config.head_dim,
                       config.intermediate_size,
                       config.moe.intermediate_size if config.moe is not None else 0)
