"""The tier's bookkeeping: byte budget, LRU order across ranks, runs, the moves' wire form, and
the pool's eviction record that write-back reads."""

from __future__ import annotations

import numpy as np
import pytest

from kvfleet.allocator.block_pool import BlockPool
from kvfleet.allocator.kv_cache_manager import group_key
from kvfleet.worker.executor.tp.wire import decode_moves, encode_moves
from kvfleet.worker.kv_tier.store import HostTierStore

BLOCK = 64  # bytes per block below


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _run(*values: int) -> np.ndarray:
    return np.stack([np.full(BLOCK, v, dtype=np.uint8) for v in values])


def test_lru_within_the_byte_budget_and_runs_come_back_in_order() -> None:
    store = HostTierStore(3 * BLOCK)
    assert store.put(0, [_h(1), _h(2), _h(3)], _run(1, 2, 3)) == 3
    assert store.lookup([_h(2)], [0]) == 1  # a lookup changes no recency
    assert store.get(0, [_h(1)]) is not None  # a restore makes 1 the most recently used
    store.put(0, [_h(4)], _run(4))          # evicts 2, the least recently used
    assert store.lookup([_h(1), _h(2)], [0]) == 1
    got = store.get(0, [_h(3), _h(1), _h(4)])
    assert got is not None and got[:, 0].tolist() == [3, 1, 4]
    assert store.get(0, [_h(2)]) is None
    s = store.stats()
    assert (s.bytes_used, s.blocks, s.stored, s.evicted, s.restored) == (3 * BLOCK, 3, 4, 1, 4)
    store.check_invariants()


def test_a_key_is_per_rank_and_lookup_needs_every_rank() -> None:
    store = HostTierStore(10 * BLOCK)
    store.put(0, [_h(1), _h(2)], _run(1, 2))
    store.put(1, [_h(1)], _run(9))
    assert store.lookup([_h(1), _h(2)], [0]) == 2
    assert store.lookup([_h(1), _h(2)], [0, 1]) == 1  # rank 1 lacks block 2
    assert store.get(1, [_h(1)])[0, 0] == 9 and store.get(0, [_h(1)])[0, 0] == 1


def test_hottest_is_lru_order_filtered_by_writer_and_every_rank() -> None:
    store = HostTierStore(8 * BLOCK)
    store.put(0, [_h(1), _h(2), _h(3)], _run(1, 2, 3), tag=b"m1")
    store.put(1, [_h(1), _h(2)], _run(1, 2), tag=b"m1")
    store.put(0, [_h(4)], _run(4), tag=b"m2")  # another model's
    assert store.hottest(b"m1", [0], 10) == [_h(3), _h(2), _h(1)]  # most recent first
    assert store.hottest(b"m1", [0, 1], 10) == [_h(2), _h(1)]  # rank 1 lacks 3
    assert store.hottest(b"m2", [0], 10) == [_h(4)]
    assert store.hottest(b"m1", [0], 2) == [_h(3), _h(2)] and store.hottest(b"m1", [0], 0) == []
    assert store.get(0, [_h(1)]) is not None  # a read makes 1 the hottest; hottest() changed nothing
    assert store.hottest(b"m1", [0], 10) == [_h(1), _h(3), _h(2)]
    store.put(0, [_h(5), _h(6), _h(7), _h(8)], _run(5, 6, 7, 8))  # evicts rank 0's 2 and 3
    assert store.hottest(b"m1", [0], 10) == [_h(1)]
    store.check_invariants()
    store.clear()
    assert store.hottest(b"m1", [0], 10) == []
    store.check_invariants()


def test_stored_blocks_are_copies_and_oversized_blocks_are_refused() -> None:
    store = HostTierStore(BLOCK)
    run = _run(5)
    store.put(0, [_h(1)], run)
    run[:] = 0
    assert store.get(0, [_h(1)])[0, 0] == 5
    assert store.put(0, [_h(2)], np.zeros((1, 2 * BLOCK), np.uint8)) == 0
    with pytest.raises(ValueError, match="2 blocks for 1 hashes"):
        store.put(0, [_h(3)], _run(1, 2))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTierStore(-1)


def test_block_moves_round_trip_the_wire() -> None:
    moves = [(3, _h(7)), (11, bytes(range(16)))]
    assert decode_moves(encode_moves(moves)) == moves
    grouped = moves + [(5, group_key(2, _h(7))), ((1 << 40) - 1, group_key(255, _h(8)))]
    assert decode_moves(encode_moves(grouped)) == grouped  # a layer group's page keys too
    assert list(encode_moves(moves)[::3]) == [3, 11]  # plain chain hashes: the block alone
    with pytest.raises(ValueError, match="block id"):
        encode_moves([(1 << 40, _h(7))])
    with pytest.raises(ValueError, match="16"):
        encode_moves([(1, b"short")])
    with pytest.raises(ValueError, match="malformed"):
        decode_moves(np.zeros(4, dtype="<i8"))


def test_the_pool_records_each_evicted_registered_block_once() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, _h(1))
    pool.release([a, b])          # a evictable, b free
    evicted: list[tuple[int, bytes]] = []
    pool.allocate(1, evicted)     # the free block first: nothing evicted
    assert evicted == []
    (c,) = pool.allocate(1, evicted)  # now a is evicted
    assert c == a and evicted == [(a, _h(1))]
    pool.check_invariants()
