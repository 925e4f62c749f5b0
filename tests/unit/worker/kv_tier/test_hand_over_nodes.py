"""Drain hand-over to a survivor on another node (issue 26 §3): the drained replica's hottest
blocks sit in node X's tier; a survivor on node Y, hinted with that tier, copies the run into
its own node's tier (the relay), restores it, and its logits equal recomputation. Two
in-process stores stand in for the two nodes' tier actors. The survivor asks by its own chain
hashes: a tier holding the same tokens under another tenant's chain gives nothing, an answer
that is not a leading run of its chain is refused, a dead source tier leaves it to recompute."""

from __future__ import annotations

import asyncio
import dataclasses

from kvfleet.index_keys import tier_id
from kvfleet.worker.kv_tier.peer_client import TierPeer
from kvfleet.worker.kv_tier.peer_pull import Exported, PeerHint
from kvfleet.worker.kv_tier.store import HostTierStore
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.kv_tier.peer_harness import InProcessRelay, puller
from tests.unit.worker.kv_tier.tier_harness import (
    TIER_BYTES,
    chain_of,
    parity_error,
    restored_blocks,
    tier_engine,
)

X, Y = "node-x", "node-y"


def _drained_on_x(model_dir, base: list[int], tenant: str = "default"):
    """Node X's store after a replica there ran ``base`` (as ``tenant``) and drained."""
    x = HostTierStore(TIER_BYTES)
    drained, _, tier, _ = tier_engine(model_dir, x)
    run(drained, [dataclasses.replace(request(base, max_tokens=2), tenant=tenant)])
    assert drained.hand_over(drained.kv.num_total_blocks) >= 5 and tier.flush()
    return x


def _survivor_on_y(model_dir, x: HostTierStore):
    """(survivor engine, its recorder, node Y's store, its puller: node tiers through
    :class:`TierPeer`, other nodes' blocks through the relay)."""
    y = HostTierStore(TIER_BYTES)
    engine, rec, _, _ = tier_engine(model_dir, y)
    relay = InProcessRelay(y, {X: x})
    p = puller(None, engine, node=Y, relay=relay, tiers=TierPeer(relay.source, [0]))
    return engine, rec, y, p


def _tier_hint(num_blocks: int) -> PeerHint:
    return PeerHint("", "", num_blocks, 0, tier_id(X))


def test_a_survivor_on_another_node_restores_the_drained_replicas_blocks(tiny_llama_dir):
    base = prompt(22, seed=61)  # 5 full blocks of 4
    x = _drained_on_x(tiny_llama_dir, base)
    survivor, rec, y, p = _survivor_on_y(tiny_llama_dir, x)
    again = request(base + prompt(3, seed=62), max_tokens=3)
    pulled = asyncio.run(p.prepare(again, _tier_hint(5)))
    assert not pulled.tier_skip and p.stats.pulls == 1 and p.stats.pulled_blocks == 5
    assert y.lookup(chain_of(survivor, again)[:5], [0]) == 5  # copied X → Y
    results = run(survivor, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert restored_blocks(rec, again.request_id) == 5  # never computed on the survivor
    assert parity_error(tiny_llama_dir, rec, again, results) <= 1
    survivor.kv.check_invariants()
    x.check_invariants()
    y.check_invariants()


def test_another_tenants_blocks_are_never_handed_over(tiny_llama_dir):
    """Negative control: node X holds the same tokens under tenant a's chain; tenant b's
    request asks by its own chain hashes and gets none of them; it recomputes."""
    base = prompt(22, seed=63)
    x = _drained_on_x(tiny_llama_dir, base, tenant="a")
    survivor, _, y, p = _survivor_on_y(tiny_llama_dir, x)
    again = dataclasses.replace(request(base + prompt(3, seed=64), max_tokens=3), tenant="b")
    pulled = asyncio.run(p.prepare(again, _tier_hint(5)))
    assert p.stats.pulled_blocks == 0 and y.stats().blocks == 0
    results = run(survivor, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0


class _Lying(TierPeer):
    """A tier source whose answer names a hash of another chain in place of the last one."""

    async def export(self, hint, hashes, timeout_s) -> Exported:
        got = await super().export(hint, hashes, timeout_s)
        return got._replace(hashes=got.hashes[:-1] + (bytes(16),))


def test_a_mismatched_chain_hash_is_refused_and_a_dead_source_recomputes(tiny_llama_dir):
    base = prompt(22, seed=65)
    x = _drained_on_x(tiny_llama_dir, base)
    survivor, _, y, p = _survivor_on_y(tiny_llama_dir, x)
    again = request(base + prompt(3, seed=66), max_tokens=3)
    p.tiers = _Lying(p.relay.source, [0])  # type: ignore[union-attr]
    pulled = asyncio.run(p.prepare(again, _tier_hint(5)))
    assert p.stats.refused == 1 and pulled.tier_skip and y.stats().blocks == 0

    def gone(node: str):
        raise ConnectionError(f"the tier actor of {node} died")

    p.tiers = TierPeer(gone, [0])
    pulled = asyncio.run(p.prepare(again, _tier_hint(5)))
    assert p.stats.failed == 1 and pulled == again and y.stats().blocks == 0
    # Not a tier hint's business without a tier client: skipped, not failed.
    p.tiers = None
    asyncio.run(p.prepare(again, _tier_hint(5)))
    assert p.stats.skipped == 1
