"""An exporting replica killed in the middle of a pull (issue 26, "Faults"): replica A has
referenced the blocks, its step has snapshotted them and its writer is inside the put to the
node's tier when A dies (its engine loop stops; the put never lands). B's wait ends at its
timeout and B recomputes with the logits of full recomputation; the tier holds none of those
bytes, A's references went with its step's moves, and nothing is held on B. Two engines of one
node in process, A on its real engine loop, the node's store shared."""

from __future__ import annotations

import asyncio
import threading

from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.kv_tier.peer_harness import LoopPeer, hint, puller, with_loop
from tests.unit.worker.kv_tier.tier_harness import TIER_BYTES, parity_error, tier_engine


class _DyingPut:
    """A's view of the node's store: a put enters, waits until ``die`` is set, then fails as a
    put from a process that is gone (nothing lands); every other call goes to ``store``."""

    def __init__(self, store: HostTierStore) -> None:
        self.store = store
        self.entered = threading.Event()
        self.die = threading.Event()

    def put(self, rank, hashes, run, tag=b""):
        self.entered.set()
        self.die.wait(30.0)
        raise ConnectionError("the exporting replica's process is gone")

    def __getattr__(self, name):
        return getattr(self.store, name)


def _idle(engine) -> None:
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_an_exporter_killed_mid_put_leaves_the_request_to_recompute_and_nothing_leaks(
        tiny_llama_dir) -> None:
    store = HostTierStore(TIER_BYTES)
    a, _, a_tier, _ = tier_engine(tiny_llama_dir, store)
    base = prompt(22, seed=81)
    run(a, [request(base, max_tokens=2)])
    assert a_tier.flush() and store.stats().blocks == 0
    b, rec, _, _ = tier_engine(tiny_llama_dir, store)
    dying = _DyingPut(store)
    a_tier.store = dying  # A's writer puts through it
    again = request(base + prompt(3, seed=82), max_tokens=3)

    async def pull(loop):
        p = puller(LoopPeer(loop), b, max_timeout_s=1.0)
        task = asyncio.ensure_future(p.prepare(again, hint(5)))
        assert await asyncio.to_thread(dying.entered.wait, 10.0), "the put never started"
        loop.stop()  # A dies with its put in flight
        return await task, p

    pulled, p = asyncio.run(with_loop(a, pull))
    assert (p.stats.failed, p.stats.timed_out, p.stats.pulls) == (1, 1, 0)
    assert not pulled.tier_skip
    dying.die.set()
    assert a_tier.flush(10.0)  # the put failed: dropped, never landed
    assert a_tier.stats.dropped_write_backs == 5 and a_tier.stats.write_backs == 0
    assert store.stats().blocks == 0 and store.stats().bytes_used == 0
    store.check_invariants()
    assert a.exports.exported_blocks == 5  # snapshotted: the references went with the step
    _idle(a)
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    _idle(b)
