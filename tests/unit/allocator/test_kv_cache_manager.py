"""KVCacheManager: exact block ids and orders (vLLM style), the reference paging example,
prefix reuse, fork and copy-on-write."""

import pytest

from kvfleet.allocator.hashing import block_hash_chain
from kvfleet.allocator.kv_cache_manager import KVCacheManager, NoFreeBlocksError

ROOT = b"\x00" * 16


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    yield manager
    manager.check_invariants()


def slots(kv, *requests):
    return sum(kv.num_blocks(r) for r in requests) * kv.block_size


def test_blocks_for():
    assert [KVCacheManager.blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert KVCacheManager.blocks_for(17, 16) == 2


def test_fresh_allocation_order(kv):
    assert kv.allocate_slots("a", 5) == [0, 1]
    assert kv.allocate_slots("b", 3) == [2]
    assert kv.allocate_slots("a", 9) == [3]
    assert kv.block_table("a") == [0, 1, 3]
    assert kv.allocate_slots("a", 9) == []  # already covered: absolute count, not delta
    assert kv.num_free_blocks == 6


def test_reference_paging_example(kv):
    """Block size 4: A at 5 tokens on [7, 2], B at 3 on [9]; growth needs a free block."""
    for i in range(10):                      # every block held by a one-block request
        assert kv.allocate_slots(f"r{i}", 1) == [i]
    for i in (7, 2, 9):                      # freed in this order: free list [7, 2, 9]
        kv.free(f"r{i}")
    assert kv.allocate_slots("A", 5) == [7, 2]  # positions 0-3 in block 7, position 4 in 2
    assert kv.allocate_slots("B", 3) == [9]
    assert slots(kv, "A", "B") == 12         # 12 slots reserved for 8 live tokens
    assert kv.num_free_blocks == 0           # a 12-slot pool: nothing left

    assert kv.allocate_slots("A", 9) is None    # growth to 9 tokens must be refused ...
    assert kv.block_table("A") == [7, 2]        # ... and nothing changed
    assert kv.num_free_blocks == 0
    kv.check_invariants()

    kv.free("r0")
    assert kv.allocate_slots("A", 9) == [0]
    assert kv.block_table("A") == [7, 2, 0]
    assert slots(kv, "A", "B") == 16         # 16 slots for 12 live tokens
    kv.free("r1")
    assert kv.allocate_slots("A", 13) == [1]
    assert slots(kv, "A", "B") == 20         # A at 13 tokens: 4 blocks + B's 1


def test_free_releases_in_reverse_and_unknown_is_noop(kv):
    kv.allocate_slots("a", 12)
    kv.free("a")
    kv.free("a")
    kv.free("never")
    assert kv.num_free_blocks == 10
    assert kv.allocate_slots("b", 40) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


def prompt_hashes(tokens, bs=4):
    return block_hash_chain(ROOT, tokens, bs)


def test_prefix_reuse_takes_refs_and_stops_before_the_last_token(kv):
    tokens = list(range(12))                    # three full blocks
    hashes = prompt_hashes(tokens)
    assert kv.allocate_slots("a", 12) == [0, 1, 2]
    kv.cache_full_blocks("a", hashes, 12)
    assert kv.take_events() == (hashes, [])
    kv.cache_full_blocks("a", hashes, 12)       # idempotent
    assert kv.take_events() == ([], [])
    # Same 12-token prompt: at most (12 - 1) // 4 = 2 blocks reused, last token recomputed.
    assert kv.get_computed_blocks(hashes, 12) == [0, 1]
    assert kv.get_computed_blocks(hashes, 13) == [0, 1, 2]
    other_root = block_hash_chain(b"\x01" * 16, tokens, 4)  # another tenant / identity
    assert kv.get_computed_blocks(other_root, 13) == []
    computed = kv.get_computed_blocks(hashes, 12)
    assert kv.ref_count(0) == 1                 # get_computed_blocks takes nothing
    assert kv.allocate_slots("b", 12, computed) == [3]
    assert kv.block_table("b") == [0, 1, 3]
    assert (kv.ref_count(0), kv.ref_count(1), kv.ref_count(2)) == (2, 2, 1)


def test_cached_blocks_survive_free_and_evict_tail_first(kv):
    hashes = prompt_hashes(list(range(12)))
    kv.allocate_slots("a", 12)
    kv.cache_full_blocks("a", hashes, 12)
    kv.take_events()
    kv.free("a")
    assert kv.num_free_blocks == 10             # evictable blocks count as free
    computed = kv.get_computed_blocks(hashes, 13)
    assert computed == [0, 1, 2]
    kv.allocate_slots("b", 7 * 4)               # uses the 7 never-cached blocks first
    assert kv.block_table("b") == [3, 4, 5, 6, 7, 8, 9]
    assert kv.allocate_slots("b", 8 * 4) == [2]  # then evicts the chain's tail block first
    assert kv.take_events() == ([], [hashes[2]])
    assert kv.get_computed_blocks(hashes, 13) == [0, 1]


def test_reusing_evictable_blocks_counts_against_free_blocks(kv):
    hashes = prompt_hashes(list(range(8)))
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", hashes, 8)
    kv.free("a")
    kv.allocate_slots("filler", 8 * 4)          # 8 free-list blocks
    computed = kv.get_computed_blocks(hashes, 9)
    assert computed == [0, 1]
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots("b", 9, computed) is None  # needs 2 reused + 1 new > 2 free
    assert "b" not in kv and kv.ref_count(0) == 0 and kv.num_free_blocks == 2
    assert kv.allocate_slots("c", 8, computed) == []    # exactly the two cached blocks
    assert kv.block_table("c") == [0, 1] and kv.num_free_blocks == 0


def test_cache_full_blocks_registers_only_full_computed_blocks(kv):
    tokens = list(range(10))
    hashes = prompt_hashes(tokens)              # 2 full blocks hashed
    kv.allocate_slots("a", 10)
    kv.cache_full_blocks("a", hashes, 7)        # block 1 not fully computed yet
    assert kv.take_events() == ([hashes[0]], [])
    kv.cache_full_blocks("a", hashes, 10)
    assert kv.take_events() == ([hashes[1]], [])


def test_duplicate_content_keeps_the_first_registration(kv):
    hashes = prompt_hashes(list(range(4)))
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 4)
    kv.cache_full_blocks("a", hashes, 4)
    kv.cache_full_blocks("b", hashes, 4)
    assert kv.get_computed_blocks(hashes, 5) == [0]
    kv.free("b")
    assert kv.pool.num_evictable == 0           # b's copy was never registered


def test_fork_and_copy_on_write(kv):
    kv.allocate_slots("p", 6)                   # [0, 1], block 1 half full
    kv.fork("p", "c")
    assert kv.block_table("c") == [0, 1] and kv.ref_count(1) == 2
    assert kv.copy_on_write("c") == [(1, 2)]    # c gets a private copy of its last block
    assert kv.block_table("c") == [0, 2] and kv.block_table("p") == [0, 1]
    assert (kv.ref_count(0), kv.ref_count(1), kv.ref_count(2)) == (2, 1, 1)
    assert kv.copy_on_write("p") == []          # p's last block is no longer shared
    assert kv.copy_on_write("unknown") == []
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 10


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate_slots("p", 5)
    kv.fork("p", "c")
    with pytest.raises(NoFreeBlocksError):
        kv.copy_on_write("c")
    assert kv.block_table("c") == [0, 1] and kv.ref_count(1) == 2
    kv.check_invariants()


def test_fork_refusals(kv):
    kv.allocate_slots("p", 1)
    with pytest.raises(ValueError):
        kv.fork("nobody", "c")
    kv.fork("p", "c")
    with pytest.raises(ValueError):
        kv.fork("p", "c")


def test_allocate_slots_input_errors(kv):
    with pytest.raises(ValueError):
        kv.allocate_slots("a", -1)
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 4, [99])
    with pytest.raises(ValueError):             # a free-list block is not a computed block
        kv.allocate_slots("a", 4, [0])
    kv.allocate_slots("a", 4)
    kv.cache_full_blocks("a", prompt_hashes([1, 2, 3, 4]), 4)
    with pytest.raises(ValueError):             # computed blocks only on the first call
        kv.allocate_slots("a", 8, [0])


def test_unknown_request_has_an_empty_table(kv):
    assert kv.block_table("x") == [] and kv.num_blocks("x") == 0


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    hashes = prompt_hashes(list(range(8)))
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", hashes, 8)
    assert kv.take_events() == ([], [])
    assert kv.get_computed_blocks(hashes, 9) == []
    kv.free("a")
    assert kv.pool.num_evictable == 0 and kv.num_free_blocks == 4
    kv.check_invariants()
