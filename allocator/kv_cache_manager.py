"""Per-request block tables over a :class:`BlockPool` — what the worker's scheduler calls.

A request's ``block_table`` lists physical block ids in logical order: token position ``p``
lives in block ``block_table[p // block_size]`` at offset ``p % block_size`` (the table, not
physical adjacency, keeps token order). Full blocks are registered under their chain hash
(:mod:`kvfleet.allocator.hashing`) once their KV is written, and reused by later requests with
the same prefix (docs/design.md §2 "Reuse rule", §3 "Prefix cache").
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from kvfleet.allocator.block_pool import BlockPool, NoFreeBlocksError
from kvfleet.allocator.units import cdiv

__all__ = ["KVCacheManager", "NoFreeBlocksError"]


class KVCacheManager:
    """Per-request block tables over a BlockPool (ref counts, prefix-cache registry,
    LRU eviction)."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching,
)
        self._tables: dict[str, list[int]] = {}

    @staticmethod
    def blocks_for(num_tokens: int, block_size: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions: ceil(num_tokens / block_size)."""
        return cdiv(num_tokens, block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks referenced by no live request: free list + cached-but-unreferenced (evictable)."""
        return self.pool.num_free

    def ref_count(self, block_id: int) -> int:
        """Live references to ``block_id`` (0: free or evictable)."""
        return self.pool.ref_count(block_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for an unknown request)."""
        return list(self._tables.get(request_id, ()))

    def num_blocks(self, request_id: str) -> int:
        """Blocks the request holds (0 for an unknown request)."""
        return len(self._tables.get(request_id, ()))

    def get_computed_blocks(self, block_hashes: Sequence[bytes],
                            num_prompt_tokens: int) -> list[int]:
        """Leading blocks of the chain found in the registry, at most
        ``(num_prompt_tokens - 1) // block_size`` of them (the last prompt token is always
        recomputed, docs/design.md §2). Takes no references and changes nothing."""
        if not self.enable_prefix_caching:
            return []
        limit = max(0, (num_prompt_tokens - 1) // self.block_size)
        computed = []
        for block_hash in block_hashes[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed

    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed_blocks: Sequence[int] = (),
                       evicted: list[tuple[int, bytes]] | None = None) -> list[int] | None:
        """Make the request's table cover ``num_tokens`` positions in total (not a delta).

        On the request's first call ``computed_blocks`` (from :meth:`get_computed_blocks`)
        become the head of its table, each taking a reference. Then
        ``ceil(num_tokens / block_size) - len(table)`` new blocks are allocated (free list
        first, then LRU eviction of cached blocks; each evicted ``(block, hash)`` is appended
        to ``evicted`` when given). Returns the new block ids, or None when not enough blocks
        are free — and then nothing changed at all.

        Raises:
            ValueError: negative ``num_tokens``, a computed block that is out of range or
                neither cached nor in use, or ``computed_blocks`` given for a request that
                already has a table.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        table = self._tables.get(request_id)
        if table is not None and computed_blocks:
            raise ValueError(f"request {request_id!r} already has a block table; "
                             "computed_blocks are only taken on its first call")
        for block in computed_blocks:
            if not 0 <= block < self.num_total_blocks:
                raise ValueError(f"block id {block} out of range [0, {self.num_total_blocks})")
            if self.pool.ref_count(block) == 0 and self.pool.block_hash(block) is None:
                raise ValueError(f"computed block {block} is neither cached nor in use")
        held = len(table) if table is not None else len(computed_blocks)
        need = max(0, self.blocks_for(num_tokens, self.block_size) - held)
        # Reused blocks that nobody references leave the evictable set when taken.
        unreferenced = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if need + unreferenced > self.pool.num_free:
            return None
        if table is None:
            self.pool.take(computed_blocks)
            table = self._tables[request_id] = list(computed_blocks)
        new_blocks = self.pool.allocate(need, evicted)
        table.extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[bytes],
                          num_computed_tokens: int, from_token: int = 0) -> None:
        """Register each full block of the table (all positions < ``num_computed_tokens``) that
        has a hash (``block_hashes[i]`` belongs to ``block_table[i]``). Idempotent; a hash
        already held by another block keeps its existing registration. ``from_token``: skip
        blocks that were already full before that many tokens were computed (an engine step
        passes its chunk's start, so each step only looks at the blocks it filled)."""
        table = self._tables.get(request_id)
        if table is None or not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table), len(block_hashes))
        for i in range(from_token // self.block_size, num_full):
            self.pool.register(table[i], block_hashes[i])

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those that hold ``num_tokens`` positions, tail
        first (the blocks only rejected speculative drafts were written to; such blocks were
        never registered, so they go back to the free list)."""
        table = self._tables.get(request_id)
        keep = self.blocks_for(num_tokens, self.block_size)
        if table is not None and len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.pool.release(reversed(tail))

    def free(self, request_id: str) -> None:
        """Release every reference of the request (unknown id: no-op), tail block first, so the
        end of a cached chain is evicted before its beginning."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.release(reversed(table))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's table, one more reference per block (parallel sampling).

        Raises:
            ValueError: unknown parent, or ``child_id`` already has a table.
        """
        if parent_id not in self._tables:
            raise ValueError(f"cannot fork unknown request {parent_id!r}")
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        table = self._tables[parent_id]
        self.pool.take(table)
        self._tables[child_id] = list(table)

    def copy_on_write(self, request_id: str, evicted: list[tuple[int, bytes]] | None = None
                      ) -> tuple[int, int] | None:
        """Before writing into the request's last block: if that block is shared (ref > 1), put
        a fresh block in its place and return ``(src_block, dst_block)`` for the model runner
        to copy the KV; else None. ``evicted``: as for :meth:`allocate_slots`.

        Raises:
            NoFreeBlocksError: the block is shared and no block is free (nothing changed).
        """
        table = self._tables.get(request_id)
        if not table or self.pool.ref_count(table[-1]) <= 1:
            return None
        src = table[-1]
        (dst,) = self.pool.allocate(1, evicted)
        self.pool.release([src])
        table[-1] = dst
        return src, dst

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored hashes, removed hashes) since the last call, then cleared.

        Net changes: the lists are disjoint (see :mod:`kvfleet.allocator.block_pool`)."""
        return self.pool.take_events()

    def cached_hashes(self) -> set[bytes]:
        """Every hash currently registered (referenced or evictable)."""
        return self.pool.cached_hashes()

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of tables holding it,
        and no table holds a block twice."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{request_id!r} holds a block twice"
            holders.update(table)
        for block in range(self.num_total_blocks):
            assert self.pool.ref_count(block) == holders[block], (
                f"block {block}: ref count {self.pool.ref_count(block)}, "
                f"held by {holders[block]} tables")
