"""Fixed-size KV blocks: ref counts, a free list, and a prefix-cache registry with LRU eviction.

Every block is in exactly one of three states (docs/design.md §3, "Prefix cache"):

- **free**: ref count 0, holds no registered hash; kept in a FIFO free list;
- **evictable**: ref count 0 but registered under a chain hash (its KV is still reusable);
  kept in LRU order, least recently released first;
- **referenced**: ref count > 0 (registered or not).

"Free blocks" as the rest of kvfleet counts them = free + evictable (referenced by no live
request). Allocation takes from the free list first and evicts the least recently released
evictable block only when the free list is empty; evicting un-registers the block's hash.

Registry changes are reported as *net* events since the last :meth:`BlockPool.take_events`: a
hash registered and evicted within one period appears in neither list, a hash evicted and
registered again appears in neither, so the two lists are always disjoint and can be applied to
an index in any order.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Iterable


class NoFreeBlocksError(Exception):
    """More blocks were asked for than are free (free list + evictable)."""


class BlockPool:
    """``num_blocks`` KV blocks with ref counts and a registry of full blocks keyed by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        # Registered blocks whose KV the host tier already holds (restored from it): evicting
        # one writes nothing back.
        self._in_tier: set[int] = set()
        self._stored: dict[bytes, None] = {}  # insertion-ordered sets
        self._removed: dict[bytes, None] = {}

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks referenced by nobody: the free list plus the evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block registered under ``block_hash``, if any."""
        return self._hash_to_block.get(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_to_hash.get(block_id)

    def cached_hashes(self) -> set[bytes]:
        return set(self._hash_to_block)

    # ---- state changes -----------------------------------------------------------------------
    def allocate(self, n: int, evicted: list[tuple[int, bytes]] | None = None) -> list[int]:
        """Take ``n`` blocks (ref count 1 each): free list first (FIFO), then evict LRU.
        ``evicted``: where to append ``(block, hash)`` of each registered block evicted for
        reuse, in eviction order (the host tier writes their KV back before a forward
        overwrites them), but those the tier holds already (:meth:`mark_in_tier`); None: not
        recorded.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free; nothing changed.
        """
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                if evicted is not None and block not in self._in_tier:
                    evicted.append((block, self._block_to_hash[block]))
                self._unregister(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def take(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (an evictable block stops being evictable)."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                assert block in self._evictable, f"block {block} is on the free list"
                del self._evictable[block]
            self._ref_counts[block] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order; a block reaching 0 becomes evictable
        (appended as most recently used) if registered, else goes to the tail of the free list."""
        for block in block_ids:
            assert self._ref_counts[block] > 0, f"block {block} released more than taken"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._block_to_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Register a referenced, full block under ``block_hash``.

        Returns False (and changes nothing) when caching is off, the block already has a hash,
        or another block already holds this hash (the existing registration is kept).
        """
        if not self.enable_caching or block_id in self._block_to_hash:
            return False
        if block_hash in self._hash_to_block:
            return False
        assert self._ref_counts[block_id] > 0, f"registering unreferenced block {block_id}"
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        if block_hash in self._removed:
            del self._removed[block_hash]  # present at the last take_events: no net change
        else:
            self._stored[block_hash] = None
        return True

    def mark_in_tier(self, block_ids: Iterable[int]) -> None:
        """The host tier holds these registered blocks' KV (they were restored from it): their
        eviction is not recorded for write-back. Forgotten when a block is unregistered."""
        for block in block_ids:
            assert block in self._block_to_hash, f"block {block} is not registered"
            self._in_tier.add(block)

    def _unregister(self, block_id: int) -> None:
        self._in_tier.discard(block_id)
        block_hash = self._block_to_hash.pop(block_id)
        del self._hash_to_block[block_hash]
        if block_hash in self._stored:
            del self._stored[block_hash]  # stored since the last take_events: no net change
        else:
            self._removed[block_hash] = None

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes newly registered, hashes evicted) since the last call, net; then cleared."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed

    def hot_blocks(self) -> list[tuple[int, bytes]]:
        """``(block, hash)`` of every registered block, hottest first: those in use, then the
        evictable ones from the most to the least recently released (a drain hands them
        over in this order)."""
        in_use = [(b, h) for b, h in self._block_to_hash.items() if self._ref_counts[b] > 0]
        idle = [(b, self._block_to_hash[b]) for b in reversed(self._evictable)]
        return in_use + idle

    # ---- invariants --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """free + evictable + referenced == total; refs >= 0; nothing both free and referenced;
        free blocks unregistered, evictable ones registered; registry a bijection."""
        free, evictable = Counter(self._free), set(self._evictable)
        assert all(c == 1 for c in free.values()), "a block is twice on the free list"
        assert not (free.keys() & evictable), "a block is both free and evictable"
        referenced = {b for b, r in enumerate(self._ref_counts) if r > 0}
        assert all(r >= 0 for r in self._ref_counts), "negative ref count"
        assert not (referenced & (free.keys() | evictable)), "a block is free and referenced"
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "blocks lost"
        assert not (free.keys() & self._block_to_hash.keys()), "a free block is registered"
        assert evictable <= self._block_to_hash.keys(), "an evictable block is not registered"
        assert len(self._hash_to_block) == len(self._block_to_hash), "registry not a bijection"
        for block_hash, block in self._hash_to_block.items():
            assert self._block_to_hash.get(block) == block_hash, "registry not a bijection"
        assert self.enable_caching or not self._hash_to_block, "registered with caching off"
        assert not (self._stored.keys() & self._removed.keys()), "events not net"
        assert self._in_tier <= self._block_to_hash.keys(), "a tier mark outlived its hash"
