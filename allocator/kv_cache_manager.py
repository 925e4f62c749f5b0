"""Per-request block tables over a :class:`BlockPool` — what the worker's scheduler calls.

A request's ``block_table`` lists physical block ids in logical order: token position ``p``
lives in block ``block_table[p // block_size]`` at offset ``p % block_size`` (the table, not
physical adjacency, keeps token order). Full blocks are registered under their chain hash
(:mod:`kvfleet.allocator.hashing`) once their KV is written, and reused by later requests with
the same prefix (docs/design.md §2 "Reuse rule", §3 "Prefix cache").

Layer groups (:mod:`kvfleet.allocator.layer_groups`, docs/design.md §3 "Layer groups"): a
request holds one table per group, all drawing pages from the one pool. A group with a
sliding window ``w`` releases the blocks wholly before ``num_computed_tokens - w + 1`` (no
token still to compute attends to them) and marks them :data:`NULL_BLOCK` in its table, so
such tables start with a run of holes. Group 0 keeps the ``block_table`` API of a manager
without groups (the one-group case is exactly that manager).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator, Sequence

from kvfleet.allocator.block_pool import BlockPool, NoFreeBlocksError
from kvfleet.allocator.kv_budget import group_blocks
from kvfleet.allocator.units import cdiv

__all__ = ["NULL_BLOCK", "ComputedBlocks", "KVCacheManager", "NoFreeBlocksError", "group_key",
           "is_group_key", "split_group_key"]

NULL_BLOCK = -1  # a table entry whose block a sliding group released (out of its window)
_GROUP_TAG = b"\xffkv-group"  # registry keys of groups > 0: tag + group byte + chain hash


def is_group_key(key: bytes) -> bool:
    """Whether ``key`` names a page of a layer group other than the first (:func:`group_key`),
    not a chain hash."""
    return key.startswith(_GROUP_TAG)


def group_key(group: int, block_hash: bytes) -> bytes:
    """The key group ``group``'s page of the block ``block_hash`` is registered (and kept in
    the host tier) under: the chain hash itself for group 0 (Raises ValueError outside
    0..255)."""
    if not 0 <= group <= 255:
        raise ValueError(f"layer group {group} outside 0..255")
    return block_hash if group == 0 else _GROUP_TAG + bytes((group,)) + block_hash


def split_group_key(key: bytes) -> tuple[int, bytes]:
    """``(group, chain hash)`` of a :func:`group_key`."""
    if not is_group_key(key):
        return 0, key
    return key[len(_GROUP_TAG)], key[len(_GROUP_TAG) + 1:]


class ComputedBlocks:
    """A prefix hit over several layer groups: ``len()`` is the hit in blocks (``k``; the hit
    covers ``k * block_size`` tokens), ``groups[g]`` group ``g``'s table head (``k`` entries,
    :data:`NULL_BLOCK` before a sliding group's window), iteration yields every real block."""

    __slots__ = ("groups",)

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self.groups = tuple(tuple(g) for g in groups)

    def __len__(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    def __iter__(self) -> Iterator[int]:
        return (b for g in self.groups for b in g if b != NULL_BLOCK)

    def __repr__(self) -> str:
        return f"ComputedBlocks({self.groups!r})"


class KVCacheManager:
    """Per-request block tables over a BlockPool (ref counts, prefix-cache registry,
    LRU eviction), one table per layer group.

    Args:
        num_blocks: pages in the pool.
        block_size: tokens per block.
        enable_prefix_caching: register full blocks and reuse them.
        windows: each layer group's sliding window in tokens (None: full attention); the
            default is one full group (no groups).

    Raises:
        ValueError: a block size or window below 1, no group, or more than 255 groups.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,)) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 1 <= len(windows) <= 255:
            raise ValueError(f"windows: 1..255 layer groups, got {len(windows)}")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows: a sliding window must be >= 1 token, got {list(windows)}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self._windowed = any(w is not None for w in self.windows)
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._tables: dict[str, list[list[int]]] = {}
        self._holes: dict[str, list[int]] = {}  # leading NULL entries of each group's table

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
        """A copy of group 0's table of the request ([] for an unknown request)."""
        tables = self._tables.get(request_id)
        return list(tables[0]) if tables else []

    def block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Every group's table of the request (empty tables for an unknown request)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return ((),) * self.num_groups
        return tuple(tuple(t) for t in tables)

    def num_blocks(self, request_id: str) -> int:
        """Blocks the request holds over every group (0 for an unknown request)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return 0
        if not self._windowed:
            return sum(len(t) for t in tables)
        return sum(len(t) - h for t, h in zip(tables, self._holes[request_id], strict=True))

    def new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks :meth:`allocate_slots` would take to cover ``num_tokens`` positions (no
        prefix hit): over every group, the entries its table lacks."""
        need = self.blocks_for(num_tokens, self.block_size)
        tables = self._tables.get(request_id)
        if tables is None:
            return need * self.num_groups
        return sum(max(0, need - len(t)) for t in tables)

    def group_max_blocks(self, num_tokens: int, max_chunk: int) -> tuple[int, ...]:
        """Per group, the most blocks one sequence of ``num_tokens`` tokens ever holds when
        it is computed in chunks of at most ``max_chunk`` tokens: a full group
        ``ceil(T / block_size)``; a sliding group of window ``w`` at most the blocks covering
        ``w - 1 + chunk`` positions (a chunk's first query still sees ``w - 1`` keys back, and
        every token of the chunk is written before the step ends), which stops growing at the
        window. :func:`kvfleet.allocator.kv_budget.group_blocks` is the same arithmetic."""
        return group_blocks(self.windows, num_tokens, max_chunk, self.block_size)

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """:meth:`group_max_blocks` summed over the groups."""
        return sum(self.group_max_blocks(num_tokens, max_chunk))

    def capacity(self, num_tokens: int, max_chunk: int = 1) -> int:
        """Requests of ``num_tokens`` tokens the whole pool holds at once (``max_chunk``: see
        :meth:`group_max_blocks`; 1: once prefilled) — what ``kvfleet budget`` reports as
        ``max_concurrent_requests`` for the same pages."""
        return self.num_total_blocks // self.max_blocks(num_tokens, max_chunk)

    def blocks_to_grow(self, request_id: str, num_tokens: int, max_chunk: int) -> int:
        """Blocks the request may still take, beyond those it holds, until it holds
        ``num_tokens`` tokens (chunks of at most ``max_chunk``): per group its
        :meth:`group_max_blocks` less what it holds now."""
        bounds = self.group_max_blocks(num_tokens, max_chunk)
        tables = self._tables.get(request_id)
        if tables is None:
            return sum(bounds)
        holes = self._holes[request_id]
        return sum(max(0, bound - (len(t) - h))
                   for bound, t, h in zip(bounds, tables, holes, strict=True))

    # ---- prefix hits ---------------------------------------------------------------------
    @property
    def grouped(self) -> bool:
        """Whether the tables are layer groups (several, or a sliding one): a prefix hit is
        then not one leading run of chain hashes."""
        return self.num_groups > 1 or self._windowed

    def key(self, group: int, block_hash: bytes) -> bytes:
        """:func:`group_key`."""
        return group_key(group, block_hash)

    def group_keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Every group's keys of ``block_hashes``, group-major (``len(block_hashes)`` per
        group): what :meth:`longest_hit` reads a held mask over."""
        return [self.key(g, h) for g in range(self.num_groups) for h in block_hashes]

    def longest_hit(self, first: int, held: Sequence[bool]) -> int:
        """Blocks after the ``first`` a sequence already has that a store holding ``held``
        (a mask over :meth:`group_keys` of the chain's blocks ``first .. first + n - 1``)
        can supply: the largest ``m - first`` such that every full group holds blocks
        ``first .. m - 1`` and each sliding group the blocks from ``max(first, b) .. m - 1``,
        ``b`` the first block the query at ``m * block_size`` sees (blocks before ``first``
        come with the sequence's own hit, which covers at least as much of the window).

        Raises:
            ValueError: ``held`` is not ``num_groups`` equal parts.
        """
        n, rest = divmod(len(held), self.num_groups)
        if rest:
            raise ValueError(f"a held mask of {len(held)} for {self.num_groups} layer groups")
        rows = [held[g * n:(g + 1) * n] for g in range(self.num_groups)]
        for m in range(first + n, first, -1):
            ok = True
            for row, w in zip(rows, self.windows, strict=True):
                start = first if w is None else max(first,
                                                    self._first_needed(m * self.block_size, w))
                if not all(row[start - first:m - first]):
                    ok = False
                    break
            if ok:
                return m - first
        return 0

    def get_computed_blocks(self, block_hashes: Sequence[bytes],
                            num_prompt_tokens: int) -> list[int] | ComputedBlocks:
        """Leading blocks of the chain found in the registry, at most
        ``(num_prompt_tokens - 1) // block_size`` of them (the last prompt token is always
        recomputed, docs/design.md §2). Takes no references and changes nothing.

        With layer groups, a hit of ``k`` blocks (``n = k * block_size`` tokens) needs a full
        group's blocks ``0 .. k - 1`` and a sliding group's blocks covering
        ``[n - w + 1, n)`` (what the query at ``n`` sees); the longest such ``k`` is returned
        as a :class:`ComputedBlocks`."""
        if not self.enable_prefix_caching:
            return [] if self.num_groups == 1 and not self._windowed else ComputedBlocks(
                ((),) * self.num_groups)
        limit = max(0, (num_prompt_tokens - 1) // self.block_size)
        if self.num_groups == 1 and not self._windowed:
            computed = []
            for block_hash in block_hashes[:limit]:
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                computed.append(block)
            return computed
        return self._computed_groups(block_hashes[:limit])

    def _computed_groups(self, hashes: Sequence[bytes]) -> ComputedBlocks:
        found = [[self.pool.lookup(self.key(g, h)) for h in hashes]
                 for g in range(self.num_groups)]
        k = len(hashes)
        for g, w in enumerate(self.windows):
            if w is None:  # a full group: its leading run bounds the hit
                k = min(k, next((i for i, b in enumerate(found[g]) if b is None), k))
        runs = []  # per group: length of the run of hits ending at each block
        for hits in found:
            run, r = [], 0
            for b in hits:
                r = r + 1 if b is not None else 0
                run.append(r)
            runs.append(run)
        while k > 0 and not all(
                w is None or runs[g][k - 1] >= k - self._first_needed(k * self.block_size, w)
                for g, w in enumerate(self.windows)):
            k -= 1
        heads: list[list[int]] = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else min(k, self._first_needed(k * self.block_size, w))
            heads.append([NULL_BLOCK] * first + [b for b in found[g][first:k] if b is not None])
        return ComputedBlocks(heads)

    def _first_needed(self, num_computed: int, window: int) -> int:
        """First block a group of ``window`` still needs once ``num_computed`` tokens are
        computed: the next query (at ``num_computed``) sees keys from
        ``num_computed - window + 1``."""
        return max(0, num_computed - window + 1) // self.block_size

    # ---- allocation ------------------------------------------------------------------------
    def _heads(self, computed_blocks: Sequence[int] | ComputedBlocks) -> list[list[int]]:
        if isinstance(computed_blocks, ComputedBlocks):
            if computed_blocks.groups and len(computed_blocks.groups) != self.num_groups:
                raise ValueError(f"computed blocks for {len(computed_blocks.groups)} layer "
                                 f"groups, the manager has {self.num_groups}")
            return [list(g) for g in computed_blocks.groups] or [[] for _ in self.windows]
        if computed_blocks and self.num_groups > 1:
            raise ValueError("computed_blocks of several layer groups come as ComputedBlocks")
        return [list(computed_blocks)] + [[] for _ in self.windows[1:]]

    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed_blocks: Sequence[int] | ComputedBlocks = (),
                       evicted: list[tuple[int, bytes]] | None = None) -> list[int] | None:
        """Make the request's tables cover ``num_tokens`` positions in total (not a delta).

        On the request's first call ``computed_blocks`` (from :meth:`get_computed_blocks`)
        become the head of its tables, each real block taking a reference. Then every group's
        table grows to ``ceil(num_tokens / block_size)`` entries with new blocks (free list
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
        tables = self._tables.get(request_id)
        heads = self._heads(computed_blocks)
        reused = [b for head in heads for b in head if b != NULL_BLOCK]
        if tables is not None and reused:
            raise ValueError(f"request {request_id!r} already has a block table; "
                             "computed_blocks are only taken on its first call")
        for block in reused:
            if not 0 <= block < self.num_total_blocks:
                raise ValueError(f"block id {block} out of range [0, {self.num_total_blocks})")
            if self.pool.ref_count(block) == 0 and self.pool.block_hash(block) is None:
                raise ValueError(f"computed block {block} is neither cached nor in use")
        want = self.blocks_for(num_tokens, self.block_size)
        held = [len(t) for t in (tables if tables is not None else heads)]
        needs = [max(0, want - h) for h in held]
        # Reused blocks that nobody references leave the evictable set when taken.
        unreferenced = sum(1 for b in reused if self.pool.ref_count(b) == 0)
        if sum(needs) + unreferenced > self.pool.num_free:
            return None
        if tables is None:
            self.pool.take(reused)
            tables = self._tables[request_id] = heads
            self._holes[request_id] = [next((i for i, b in enumerate(h) if b != NULL_BLOCK),
                                            len(h)) for h in heads]
        new_blocks = self.pool.allocate(sum(needs), evicted)
        at = 0
        for table, need in zip(tables, needs, strict=True):
            table.extend(new_blocks[at:at + need])
            at += need
        return new_blocks

    def free_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Release, in every sliding group of the request, the blocks wholly before
        ``num_computed_tokens - window + 1`` (the first key the next query sees), marking them
        :data:`NULL_BLOCK`. Call once ``num_computed_tokens`` tokens are computed. Returns the
        blocks released (0 without sliding groups or for an unknown request)."""
        if not self._windowed or request_id not in self._tables:
            return 0
        tables, holes = self._tables[request_id], self._holes[request_id]
        released: list[int] = []
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            table = tables[g]
            end = min(self._first_needed(num_computed_tokens, w), len(table))
            for i in range(holes[g], end):
                released.append(table[i])
                table[i] = NULL_BLOCK
            holes[g] = max(holes[g], end)
        # Newest first, so the oldest (least likely reused) is evicted first.
        self.pool.release(reversed(released))
        return len(released)

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[bytes],
                          num_computed_tokens: int, from_token: int = 0) -> None:
        """Register each full block of the tables (all positions < ``num_computed_tokens``)
        that has a hash (``block_hashes[i]`` belongs to entry ``i`` of every group's table;
        holes are skipped). Idempotent; a hash already held by another block keeps its
        existing registration. ``from_token``: skip blocks that were already full before that
        many tokens were computed (an engine step passes its chunk's start, so each step only
        looks at the blocks it filled)."""
        tables = self._tables.get(request_id)
        if tables is None or not self.enable_prefix_caching:
            return
        for g, table in enumerate(tables):
            num_full = min(num_computed_tokens // self.block_size, len(table), len(block_hashes))
            for i in range(from_token // self.block_size, num_full):
                if table[i] != NULL_BLOCK:
                    self.pool.register(table[i], self.key(g, block_hashes[i]))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those that hold ``num_tokens`` positions, tail
        first (the blocks only rejected speculative drafts were written to; such blocks were
        never registered, so they go back to the free list)."""
        tables = self._tables.get(request_id)
        keep = self.blocks_for(num_tokens, self.block_size)
        for table in tables or ():
            if len(table) > keep:
                tail = table[keep:]
                del table[keep:]
                self.pool.release(b for b in reversed(tail) if b != NULL_BLOCK)

    def free(self, request_id: str) -> None:
        """Release every reference of the request (unknown id: no-op), tail block first, so the
        end of a cached chain is evicted before its beginning."""
        tables = self._tables.pop(request_id, None)
        self._holes.pop(request_id, None)
        if tables is not None:
            for table in tables:
                self.pool.release(b for b in reversed(table) if b != NULL_BLOCK)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's tables, one more reference per block (parallel
        sampling).

        Raises:
            ValueError: unknown parent, or ``child_id`` already has a table.
        """
        if parent_id not in self._tables:
            raise ValueError(f"cannot fork unknown request {parent_id!r}")
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        tables = self._tables[parent_id]
        for table in tables:
            self.pool.take(b for b in table if b != NULL_BLOCK)
        self._tables[child_id] = [list(t) for t in tables]
        self._holes[child_id] = list(self._holes[parent_id])

    def pending_copies(self, request_id: str) -> int:
        """Groups whose last block the request shares (ref > 1): blocks a write into them
        would copy first (:meth:`copy_on_write`)."""
        tables = self._tables.get(request_id)
        if not tables:
            return 0
        return sum(1 for t in tables
                   if t and t[-1] != NULL_BLOCK and self.pool.ref_count(t[-1]) > 1)

    def copy_on_write(self, request_id: str, evicted: list[tuple[int, bytes]] | None = None
                      ) -> list[tuple[int, int]]:
        """Before writing into the request's last blocks: each group's last block that is
        shared (ref > 1) is replaced by a fresh block; returns ``(src_block, dst_block)`` per
        replaced block for the model runner to copy the KV ([] when none is shared).
        ``evicted``: as for :meth:`allocate_slots`.

        Raises:
            NoFreeBlocksError: fewer blocks are free than shared ones (nothing changed).
        """
        tables = self._tables.get(request_id)
        if not tables:
            return []
        shared = [t for t in tables if t and t[-1] != NULL_BLOCK and self.pool.ref_count(t[-1]) > 1]
        if not shared:
            return []
        fresh = self.pool.allocate(len(shared), evicted)
        copies = []
        for table, dst in zip(shared, fresh, strict=True):
            src = table[-1]
            self.pool.release([src])
            table[-1] = dst
            copies.append((src, dst))
        return copies

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored hashes, removed hashes) of group 0 since the last call, then cleared (the
        router keys the prefix, not the layout: other groups' keys stay local).

        Net changes: the lists are disjoint (see :mod:`kvfleet.allocator.block_pool`)."""
        stored, removed = self.pool.take_events()
        if self.num_groups == 1:
            return stored, removed
        return ([h for h in stored if not is_group_key(h)],
                [h for h in removed if not is_group_key(h)])

    def cached_hashes(self) -> set[bytes]:
        """Every group-0 hash currently registered (referenced or evictable)."""
        hashes = self.pool.cached_hashes()
        if self.num_groups == 1:
            return hashes
        return {h for h in hashes if not is_group_key(h)}

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of table entries
        holding it over every group; no table holds a block twice; every table has one entry
        per group; holes only at the head of a sliding group's table."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, tables in self._tables.items():
            assert len(tables) == self.num_groups, f"{request_id!r}: a table per group"
            holes = self._holes[request_id]
            for g, table in enumerate(tables):
                real = [b for b in table if b != NULL_BLOCK]
                assert len(set(real)) == len(real), f"{request_id!r} holds a block twice"
                assert all(b == NULL_BLOCK for b in table[:holes[g]]), "hole count wrong"
                assert NULL_BLOCK not in table[holes[g]:], f"{request_id!r}: a hole after a block"
                assert self.windows[g] is not None or holes[g] == 0, "a full group freed a block"
                holders.update(real)
            lengths = {len(t) for t in tables}
            assert len(lengths) == 1, f"{request_id!r}: group tables of unequal length {lengths}"
        for block in range(self.num_total_blocks):
            assert self.pool.ref_count(block) == holders[block], (
                f"block {block}: ref count {self.pool.ref_count(block)}, "
                f"held by {holders[block]} table entries")
