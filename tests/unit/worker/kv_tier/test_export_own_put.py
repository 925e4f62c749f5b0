"""An export waits for its own puts into the node's tier, not for the holder's writer to go
idle: a later write-back stuck in the tier (here, another peer's export) does not hold back an
export whose blocks are already in."""

from __future__ import annotations

import asyncio
import threading

from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.kv_tier.peer_harness import with_loop
from tests.unit.worker.kv_tier.tier_harness import TIER_BYTES, chain_of, tier_engine


class _Gates(HostTierStore):
    """Puts wait for the gate of the first hash they carry (when it has one)."""

    def __init__(self) -> None:
        super().__init__(TIER_BYTES)
        self.gates: dict[bytes, threading.Event] = {}
        self.entered: dict[bytes, threading.Event] = {}

    def gate(self, h: bytes) -> threading.Event:
        self.entered[h] = threading.Event()
        self.gates[h] = threading.Event()
        return self.gates[h]

    def put(self, rank, hashes, run, tag=b""):
        first = bytes(hashes[0])
        if first in self.gates:
            self.entered[first].set()
            assert self.gates[first].wait(30)
        return super().put(rank, hashes, run, tag)


def test_an_export_answers_once_its_own_put_landed(tiny_llama_dir) -> None:
    store = _Gates()
    a, _, a_tier, _ = tier_engine(tiny_llama_dir, store)
    base = request(prompt(22, seed=91), max_tokens=2)
    run(a, [base])
    assert a_tier.flush() and store.stats().blocks == 0
    chain = chain_of(a, base)[:5]
    mine, later = tuple(chain[:2]), tuple(chain[2:])
    go_mine, go_later = store.gate(mine[0]), store.gate(later[0])

    async def body(loop):
        first = asyncio.ensure_future(loop.export_blocks(mine, 5.0))
        assert await asyncio.to_thread(store.entered[mine[0]].wait, 30)
        second = asyncio.ensure_future(loop.export_blocks(later, 30.0))
        for _ in range(3000):  # the second export's snapshot is queued behind the first
            if a.exports.exported_blocks == 5:
                break
            await asyncio.sleep(0.01)
        assert a.exports.exported_blocks == 5
        go_mine.set()  # the first export's put lands; the second's stays stuck
        try:
            return await first
        finally:
            go_later.set()
            await second

    try:
        assert asyncio.run(with_loop(a, body)) == mine
    finally:
        go_mine.set()
        go_later.set()
    assert a_tier.flush() and store.lookup(chain, [0]) == 5
