"""The paged KV cache of one rank: every layer's K and V blocks in one allocation.

With layer groups (:mod:`kvfleet.allocator.layer_groups`) a block is a *page*: ``block_size``
tokens of the ``layers_per_group`` layers of whichever group owns it (layer ``l`` at slot
``groups.slot_of(l)``), so every page has the same bytes and one pool serves every group.
One group of every layer (the default) is the layout without groups.
"""

from __future__ import annotations

import torch

from kvfleet.allocator.kv_bytes import bytes_per_token, rank_spec
from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.allocator.model_spec import AttentionLayer, ModelKVSpec
from kvfleet.worker.runner.model_config import ModelConfig

_KV_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def cache_spec(config: ModelConfig, groups: LayerGroups | None = None) -> ModelKVSpec:
    """The layout of one page as the allocator's spec: the layers of one group (``groups``;
    default one group of every layer) store K and V of every token of a block."""
    n = config.num_layers if groups is None else groups.layers_per_group
    layers = tuple(AttentionLayer(i, config.num_kv_heads, config.head_dim) for i in range(n))
    return ModelKVSpec(config.model_type, n, config.num_heads, layers,
                       config.max_position_embeddings)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1,
                       groups: LayerGroups | None = None) -> int:
    """Bytes one block (page) occupies on each of ``tp`` ranks: ``block_size`` tokens × the
    allocator's per-token formula for one rank's KV heads
    (:func:`kvfleet.allocator.kv_bytes.bytes_per_token` of ``rank_spec``; K + V, every layer
    of one group — every layer without ``groups``) — the per-rank figure
    ``kvfleet budget --tp`` prints.

    Raises:
        KeyError: a dtype the cache does not support.
        ShardingError: heads that do not split over ``tp``.
    """
    spec = rank_spec(cache_spec(config, groups), tp)
    return block_size * bytes_per_token(spec, _KV_DTYPE_NAMES[dtype])


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: torch.dtype, kv_memory_bytes: int, tp: int = 1,
    groups: LayerGroups | None = None,
) -> int:
    """How many whole blocks fit in ``kv_memory_bytes`` (bytes, integer; ``--kv-memory``: per
    rank, so every one of the ``tp`` ranks gets the same number of blocks).

    Raises:
        ValueError: not even one block fits.
    """
    per_block = kv_bytes_per_block(config, block_size, dtype, tp, groups)
    blocks = kv_memory_bytes // per_block
    if blocks < 1:
        raise ValueError(
            f"kv memory {kv_memory_bytes} B holds no block of {per_block} B "
            f"(block_size {block_size}, {config.num_layers} layers)"
        )
    return int(blocks)


class KVCache:
    """Per-layer ``key_cache``/``value_cache`` views of shape
    ``(num_blocks, block_size, num_kv_heads, head_dim)`` into one zeroed tensor
    ``(layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim)`` (``groups``:
    default one group, so ``layers_per_group == num_layers``).

    Zeroed so that padded (masked) reads never meet NaN/inf garbage.

    Raises:
        ValueError: fewer than one block or token per block; ``groups`` of another layer count.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 groups: LayerGroups | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        groups = groups or LayerGroups.single(config.num_layers)
        if groups.num_layers != config.num_layers:
            raise ValueError(f"layer groups cover {groups.num_layers} layers, the model has "
                             f"{config.num_layers}")
        self.groups = groups
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._slots = tuple(groups.slot_of(i) for i in range(config.num_layers))
        self.data = torch.zeros(
            groups.layers_per_group, 2, num_blocks, block_size, config.num_kv_heads,
            config.head_dim, dtype=dtype, device=device,
        )
        self._views = self._layer_views()

    def _layer_views(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        # Made once per `data`: each decode step asks for every layer's views, and two
        # tensor indexings per layer cost about as much as a small fused op.
        return tuple((self.data[slot, 0], self.data[slot, 1]) for slot in self._slots)

    def views(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Every layer's :meth:`layer` views, by layer: the same tuple object until the cache
        tensor is replaced (callers holding addresses compare it by identity)."""
        return self._views

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)`` of layer ``i``, views into the shared tensor (the
        blocks of its group's pages, at its slot)."""
        return self._views[i]

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: for each ``(src, dst)`` copy K and V of every slot of the page.

        All copies read the state from before any of them (a ``dst`` is never a ``src``).
        """
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.data.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def release(self) -> None:
        """Free the blocks for good (the replica stopped): ``data`` keeps its dimensions with
        0 blocks, so shapes still read; nothing may be stored after. Idempotent."""
        self.num_blocks = 0
        self.data = self.data.new_empty((*self.data.shape[:2], 0, *self.data.shape[3:]))
        self._views = self._layer_views()
