"""A peer pull under tensor parallelism: both replicas at tp=2 (ranks in threads, real gloo);
each of A's ranks exports its own KV-head shard, B waits until every rank's shard is in the
tier and each of its ranks restores its own; logits equal full recomputation."""

from __future__ import annotations

import asyncio

from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.executor.tp.thread_executor import thread_executor
from tests.unit.worker.kv_tier.peer_harness import LoopPeer, hint, puller, with_loop
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    chain_of,
    parity_error,
    restored_blocks,
    tier_engine,
)


def test_tp2_a_pulled_prefix_equals_recompute(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = HostTierStore(TIER_BYTES)
    with thread_executor(tiny_llama_dir, 2, tier=store) as ex_a, \
            thread_executor(tiny_llama_dir, 2, tier=store) as ex_b:
        a, _, _, _ = tier_engine(tiny_llama_dir, store, executor=ex_a, tp=2)
        b, rec, b_tier, _ = tier_engine(tiny_llama_dir, store, executor=ex_b, tp=2)
        base = prompt(22, seed=71)
        run(a, [request(base, max_tokens=2)])
        again = request(base + prompt(2, seed=72), max_tokens=3)

        async def pull(loop):
            p = puller(LoopPeer(loop), b)  # A answers what is in the tier for both ranks
            return await p.prepare(again, hint(5)), p

        pulled, p = asyncio.run(with_loop(a, pull))
        assert p.stats.pulls == 1 and p.stats.pulled_blocks == 5
        results = run(b, [pulled])
        assert restored_blocks(rec, again.request_id) == 5
        rank1 = ex_b.group.workers[0].tier
        assert b_tier.stats.restores == rank1.stats.restores == 5
        assert {r for _, r in store._blocks} == {0, 1}  # one shard per rank, keyed apart
        assert parity_error(tiny_llama_dir, rec, again, results) <= 1
        a.kv.check_invariants()
        assert a.kv.num_free_blocks == a.kv.num_total_blocks


def test_tp2_an_export_answers_only_blocks_in_the_tier_for_every_rank(tiny_llama_dir,
                                                                      monkeypatch) -> None:
    """A's rank 1 cannot put its shard: A answers none of the blocks (rank 0's alone are no
    block), and B recomputes instead of waiting on a shard that never comes."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")

    class _Rank1Fails(HostTierStore):
        def put(self, rank, hashes, run, tag=b""):
            if rank == 1:
                raise TimeoutError("rank 1's put did not answer")
            return super().put(rank, hashes, run, tag)

    store = _Rank1Fails(TIER_BYTES)
    with thread_executor(tiny_llama_dir, 2, tier=store) as ex_a, \
            thread_executor(tiny_llama_dir, 2, tier=store) as ex_b:
        a, _, _, _ = tier_engine(tiny_llama_dir, store, executor=ex_a, tp=2)
        b, _, _, _ = tier_engine(tiny_llama_dir, store, executor=ex_b, tp=2)
        base = prompt(22, seed=73)
        run(a, [request(base, max_tokens=2)])
        again = request(base + prompt(2, seed=74), max_tokens=3)

        async def pull(loop):
            p = puller(LoopPeer(loop), b, max_timeout_s=1.0)
            return await p.prepare(again, hint(5)), p

        pulled, p = asyncio.run(with_loop(a, pull))
        assert (p.stats.pulls, p.stats.pulled_blocks) == (0, 0)
        assert store.lookup(chain_of(a, again)[:5], [0]) == 5  # rank 0's shards did land
        run(b, [pulled])
        a.kv.check_invariants()
