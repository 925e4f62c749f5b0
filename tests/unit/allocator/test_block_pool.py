"""BlockPool: exact free-list and LRU orders, eviction, net events, invariants."""

import pytest

from kvfleet.allocator.block_pool import BlockPool, NoFreeBlocksError


@pytest.fixture
def pool():
    p = BlockPool(4)
    yield p
    p.check_invariants()


def test_allocates_fifo_and_releases_to_the_tail(pool):
    assert pool.allocate(2) == [0, 1]
    pool.release([1, 0])
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert pool.num_free == 0


def test_allocate_too_many_changes_nothing(pool):
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]


def test_registered_blocks_become_evictable_and_are_evicted_lru_only_when_free_list_empty(pool):
    a, b, c, d = pool.allocate(4)
    assert pool.register(a, b"ha") and pool.register(b, b"hb")
    pool.release([b, a, c])            # b released first: least recently used
    assert pool.num_free == 3 and pool.num_evictable == 2
    assert pool.allocate(1) == [c]     # free list first
    assert pool.take_events() == ([b"ha", b"hb"], [])
    assert pool.allocate(1) == [b]     # then the LRU evictable block
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a
    assert pool.take_events() == ([], [b"hb"])


def test_take_revives_an_evictable_block(pool):
    (a,) = pool.allocate(1)
    pool.register(a, b"h")
    pool.release([a])
    pool.take([a])
    assert pool.ref_count(a) == 1 and pool.num_evictable == 0 and pool.num_free == 3


def test_register_keeps_an_existing_registration(pool):
    a, b = pool.allocate(2)
    assert pool.register(a, b"h")
    assert not pool.register(b, b"h")      # another block holds the hash
    assert not pool.register(a, b"other")  # the block already has a hash
    assert pool.lookup(b"h") == a and pool.block_hash(b) is None


def test_events_are_net_changes(pool):
    (a,) = pool.allocate(1)
    pool.register(a, b"h")
    pool.release([a])
    pool.allocate(4)                        # evicts a within the same period
    assert pool.take_events() == ([], [])   # stored then removed: nothing to publish
    pool.release([0, 1, 2, 3])
    (x,) = pool.allocate(1)
    pool.register(x, b"h")
    assert pool.take_events() == ([b"h"], [])
    pool.release([x])
    pool.allocate(4)                        # evict h ...
    pool.release([1])
    pool.register(0, b"h")                  # ... and register it again on another block
    assert pool.take_events() == ([], [])   # present before, present after


def test_caching_off_never_registers():
    p = BlockPool(2, enable_caching=False)
    (a,) = p.allocate(1)
    assert not p.register(a, b"h")
    p.release([a])
    assert p.num_evictable == 0 and p.num_free == 2
    p.check_invariants()


def test_invariants_catch_corruption(pool):
    (a,) = pool.allocate(1)
    pool._free.append(a)  # simulate a bug: referenced and free at once
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool._free.pop()


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)
