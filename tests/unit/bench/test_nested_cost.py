"""bench/engine/nested_cost.py's plans and pause: the paused step and the nested one never
share a block, every table covers its chunk, and the pause comes after the asked layer only."""

from __future__ import annotations

from bench.engine.nested_cost import CONTEXT, pause_after, plans


def test_the_two_plans_use_disjoint_blocks_that_cover_their_chunks():
    big, small = plans(16, decode_rows=4, prefill=40, nested=20)
    assert len(big.chunks) == 5 and len(small.chunks) == 1
    assert [len(c.token_ids) for c in big.chunks] == [1, 1, 1, 1, 40]
    assert all(c.num_computed_tokens == CONTEXT for c in big.chunks[:4])
    blocks = [b for c in big.chunks + small.chunks for b in c.block_table]
    assert len(blocks) == len(set(blocks))
    for c in big.chunks + small.chunks:
        assert len(c.block_table) * 16 > c.num_computed_tokens + len(c.token_ids) - 1


def test_pause_after_is_true_once_after_its_layer():
    should_yield = pause_after(2)  # called after layers 0, 1, 2, ...
    assert [should_yield() for _ in range(6)] == [False, False, True, False, False, False]
