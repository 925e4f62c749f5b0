"""A block restored from the host tier is already there: evicting it again writes nothing
back (no copy on the step path, no room taken in the write-back queue); a block computed on
the device is written back as before."""

from __future__ import annotations

from kvfleet.allocator.block_pool import BlockPool
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.kv_tier.tier_harness import chain_of, evict_then_ask_again, tier_engine


def test_restored_blocks_are_not_written_back_again(tiny_llama_dir) -> None:
    engine, rec, tier, store = tier_engine(tiny_llama_dir)
    base = prompt(22, seed=81)  # 5 full blocks
    again = request(base + prompt(2, seed=82), max_tokens=2)
    evict_then_ask_again(engine, tier, base, again)
    assert tier.flush()
    before = tier.stats.write_backs
    restored = {h for p in rec.plans for _, h in p.block_restores}
    assert len(restored) == 5
    saves_before = len(rec.plans)
    run(engine, [request(prompt(40, seed=83), max_tokens=2)])  # evicts them again
    run(engine, [request(prompt(40, seed=84), max_tokens=2)])
    assert all(engine.kv.pool.lookup(h) is None for h in chain_of(engine, again)[:5])
    saved = [h for p in rec.plans[saves_before:] for _, h in p.block_saves]
    assert not restored & set(saved)  # the tier's own blocks were not copied again
    assert tier.flush() and tier.stats.write_backs - before == len(saved) > 0
    assert store.lookup(sorted(restored, key=chain_of(engine, again).index), [0]) == 5
    engine.kv.check_invariants()


def test_the_pool_forgets_a_tier_block_once_unregistered() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    assert pool.register(a, b"h" * 16)
    pool.mark_in_tier([a])
    pool.release([a])
    (b,) = pool.allocate(1)
    evicted: list = []
    (c,) = pool.allocate(1, evicted)  # evicts a: held by the tier, not recorded
    assert c == a and evicted == []
    assert pool.register(c, b"k" * 16)
    pool.release([b, c])
    pool.check_invariants()
    evicted = []
    pool.allocate(2, evicted)  # c is a device block now: recorded
    assert evicted == [(c, b"k" * 16)]
    pool.check_invariants()
