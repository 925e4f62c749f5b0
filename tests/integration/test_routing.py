"""Prefix-aware routing through a real router, real Redis and real gRPC, over cost-model
replicas whose scheduler, block pool and KV events are the real ones (the forward is a no-op)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

from safetensors.torch import load_file, save_file

from kvfleet.router.policy import rendezvous_score
from kvfleet.router.served_model import ServedModel
from kvfleet.worker.executor.cost_model import CostModel
from tests.integration.routing_fleet import BLOCK, Fleet, prompt


async def two_replicas(fleet: Fleet, **router_kw) -> None:
    await fleet.add_replica("rep-a")
    await fleet.add_replica("rep-b")
    await fleet.add_router(**router_kw)
    await fleet.wait_replicas(2)


async def test_the_holder_of_the_longest_prefix_wins_over_the_rendezvous_owner(fleet):
    await two_replicas(fleet)
    tokens = prompt(1, 4 * BLOCK + 5)
    chain = fleet.chain(tokens)
    owner = max(["rep-a", "rep-b"], key=lambda r: rendezvous_score(chain[0], r))
    holder = "rep-b" if owner == "rep-a" else "rep-a"
    await fleet.direct(holder, tokens)
    # The worker hashed the prompt itself: its published chain is the router's chain.
    await fleet.wait_match(chain, {holder: 4})
    assert fleet.chain(tokens) == chain and set(fleet.replicas[holder].publisher.held) >= set(chain)
    out = await fleet.generate(tokens[:-2] + [77, 78])  # same 4 blocks, another tail
    assert out.replica_id == holder and out.usage.cached_prompt_tokens == 4 * BLOCK
    # A prompt that shares only the first block: the holder of 1 block still beats nothing.
    out = await fleet.generate(tokens[:BLOCK] + prompt(2, 3 * BLOCK))
    assert out.replica_id == holder and out.usage.cached_prompt_tokens == BLOCK


async def test_a_new_family_lands_on_the_rendezvous_owner_from_every_router(fleet):
    await two_replicas(fleet)
    await fleet.add_router()
    await fleet.wait_replicas(2)
    for seed in range(10, 16):
        tokens = prompt(seed, 3 * BLOCK + 1)
        chain = fleet.chain(tokens)
        owner = max(["rep-a", "rep-b"], key=lambda r: rendezvous_score(chain[0], r))
        picks = set()
        for router in fleet.routers:
            decision = await router.core.route(router.core.models[fleet.model_name], chain)
            picks.add(decision.candidate.info.replica_id)
        assert picks == {owner}


async def test_two_routers_make_the_same_choice_for_the_same_state(fleet):
    for rid in ("rep-a", "rep-b", "rep-c"):
        await fleet.add_replica(rid)
    await fleet.add_router()
    await fleet.add_router()
    await fleet.wait_replicas(3)
    prompts = [prompt(seed, 5 * BLOCK + 3) for seed in range(20, 26)]
    for i, tokens in enumerate(prompts[:3]):  # three families warmed on three replicas
        rid = ("rep-a", "rep-b", "rep-c")[i]
        await fleet.direct(rid, tokens[: (2 + i) * BLOCK + 1])
        await fleet.wait_match(fleet.chain(tokens)[: 2 + i], {rid: 2 + i})
    for r in fleet.routers:
        await r.replicas.refresh()
    for tokens in prompts:  # warmed (longest holder) and new (rendezvous) families
        chain = fleet.chain(tokens)
        decisions = [await r.core.route(r.core.models[fleet.model_name], chain)
                     for r in fleet.routers]
        assert [d.index_source for d in decisions] == ["mirror", "mirror"]  # no Redis round trip
        picks = [d.candidate for d in decisions]
        assert picks[0].info.replica_id == picks[1].info.replica_id
        assert picks[0].matched_blocks == picks[1].matched_blocks


async def test_other_tenants_and_salts_never_hit_shared_namespaces_do(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"ka": "acme", "kb": "globex", "kc": "initech"},
                                "shared_namespaces": {"team": ["globex", "initech"]}}))
    await fleet.add_replica("rep-a")  # one replica: any hit would be a cross-tenant leak
    await fleet.add_router(api_keys_file=str(keys))
    await fleet.wait_replicas(1)
    tokens = prompt(3, 4 * BLOCK + 2)

    async def cached(key: str, salt: str = "") -> int:
        out = await fleet.generate(tokens, api_key=key, salt=salt)
        return out.usage.cached_prompt_tokens

    assert await cached("ka") == 0
    assert await cached("ka") == 4 * BLOCK       # same tenant: hit
    assert await cached("kb") == 0               # another tenant: never
    assert await cached("ka", salt="s1") == 0    # another salt: never
    assert await cached("ka", salt="s1") == 4 * BLOCK
    assert await cached("kc") == 4 * BLOCK       # same shared namespace as globex: hit
    assert await fleet.match(fleet.chain(tokens, scope="acme")) == {"rep-a": 4}
    assert await fleet.match(fleet.chain(tokens, scope="@team")) == {"rep-a": 4}


async def test_another_model_revision_never_matches(fleet, tiny_llama_dir, tmp_path):
    """Same name, same shapes, other weights (a fine-tune): another identity, no hit."""
    revised = tmp_path / "revised"
    shutil.copytree(tiny_llama_dir, revised)
    weights = load_file(revised / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name] = weights[name] + 0.5
    save_file(weights, revised / "model.safetensors", metadata={"format": "pt"})
    await fleet.add_replica("rep-a")
    await fleet.add_router()
    await fleet.wait_replicas(1)
    tokens = prompt(4, 4 * BLOCK + 1)
    await fleet.direct("rep-a", tokens)
    await fleet.wait_match(fleet.chain(tokens), {"rep-a": 4})
    other = ServedModel.load(fleet.model_name, revised, BLOCK)
    assert other.identity != fleet.routers[0].core.models[fleet.model_name].identity
    from kvfleet.allocator.hashing import block_hash_chain, root_hash
    chain = block_hash_chain(root_hash(other.identity.digest(), "default", ""), tokens, BLOCK)
    assert await fleet.match(chain) == {}


async def test_a_restarted_replica_s_old_entries_are_ignored(fleet):
    old = await fleet.add_replica("rep-a")
    await fleet.add_router()
    await fleet.wait_replicas(1)
    tokens = prompt(5, 4 * BLOCK + 1)
    await fleet.direct("rep-a", tokens)
    await fleet.wait_match(fleet.chain(tokens), {"rep-a": 4})
    # Crash: the old process stops without deregistering; a new one takes the same id.
    publisher, old.publisher = old.publisher, None
    await publisher.close()
    await old.stop(grace_s=0.1)
    new = await fleet.add_replica("rep-a")
    assert new.publisher.epoch == 2
    assert await fleet.match(fleet.chain(tokens)) == {}  # at once, not after a TTL
    await fleet.wait_replicas(1)
    out = await fleet.generate(tokens)
    assert out.replica_id == "rep-a" and out.usage.cached_prompt_tokens == 0
    await fleet.wait_match(fleet.chain(tokens), {"rep-a": 4})


async def test_a_finished_turn_in_a_stale_load_report_keeps_the_chat_on_its_holder(fleet, caplog):
    # Both replicas hold the chat template's block; a heartbeat taken while turn 1 runs says its
    # replica is busy (running=1), and the router reads that report after turn 1 has finished.
    slow = CostModel(0.05, 0.0, 0.0, "test: 50 ms per step")
    for rid in ("rep-a", "rep-b"):
        await fleet.add_replica(rid, cost_model=slow, heartbeat_interval_s=3600.0)
    router = await fleet.add_router()
    await fleet.wait_replicas(2)
    template = prompt(40, BLOCK)
    for rid in fleet.replicas:
        await fleet.direct(rid, template + [5])
    turn1 = template + prompt(41, BLOCK + 3)  # 2 full blocks + 3 generated: still 2 blocks
    await fleet.wait_match(fleet.chain(turn1), {"rep-a": 1, "rep-b": 1})
    first = asyncio.create_task(fleet.generate(turn1, max_tokens=3))
    holder = None
    while holder is None:
        await asyncio.sleep(0.005)
        holder = next((rid for rid, s in fleet.replicas.items() if s.load().running), None)
    await fleet.replicas[holder].publisher.heartbeat(fleet.replicas[holder].load())
    assert (await first).replica_id == holder
    await router.replicas.refresh()
    assert router.replicas.replicas[holder][1].running == 1  # the stale report is in use
    turn2 = turn1 + [7, 7, 7] + prompt(42, BLOCK)
    other = next(rid for rid in fleet.replicas if rid != holder)
    await fleet.wait_match(fleet.chain(turn2), {holder: 2, other: 1})
    # Scored on the report alone, 2 matched − 1 load ties 1 − 0 (this tie went to `other`
    # before ties went to the deeper match); the ledger makes the holder's load 0.
    with caplog.at_level(logging.DEBUG, logger="kvfleet.router.core"):
        out = await fleet.generate(turn2)
    assert out.replica_id == holder and out.usage.cached_prompt_tokens == 2 * BLOCK
    # The debug log shows why: the report's request is known finished (-vv on `kvfleet up`).
    decision = next(r.getMessage() for r in caplog.records if "candidates:" in r.getMessage())
    assert f"{holder} matched=2 load=0 (reported=1 settled=1 inflight=0)" in decision
    assert f"{other} matched=1 load=0" in decision
