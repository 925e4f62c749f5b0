"""Peer pulls under a LoRA adapter (issue 26 §2, "under an adapter"): replica A has served a
prompt under adapter ``qv``; replica B, told A holds it, pulls the blocks under **its own**
chain for the adapter's revision and restores them; logits equal peft's. The revision is part
of the chain: a holder at another revision exports nothing, and a revision registered on B
between the pull and admission leaves the pulled blocks unused (recomputed, never served).
Two engines of one node in process, each with its own runner and adapter slots; A runs on its
real engine loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.replica.peer_setup import adapter_digest
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request, run
from tests.unit.worker.kv_tier.peer_harness import LoopPeer, hint, puller, with_loop
from tests.unit.worker.kv_tier.tier_harness import TIER_BYTES, chain_of, restored_blocks, tier_engine
from tests.unit.worker.lora_harness import IDENTITY, MAX_LORA_RANK, lora_error, with_adapter


def _replica(model_dir: Path, adapter_dir: Path, store: HostTierStore):
    """(engine, recorder, residency) serving ``qv`` from ``adapter_dir``, over a runner of its
    own (two replicas' adapter slots must not alias), writing back to ``store``."""
    runner = ModelRunner(model_dir, num_blocks=32, block_size=BLOCK_SIZE, one_row_weights=False,
                         max_loras=1)
    executor = LocalExecutor(runner, RankTier(store, 0, runner.kv_cache))
    residency = AdapterResidency(
        executor, {"qv": check_adapter("qv", adapter_dir, runner.config, MAX_LORA_RANK)}, 1)
    engine, rec, _, _ = tier_engine(model_dir, store, executor=executor, adapters=residency,
                                    identity=IDENTITY)
    return engine, rec, residency


def _idle(engine) -> None:
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def _pull(a, b, req, blocks: int):
    """B's puller asks A (on its engine loop) for ``blocks`` blocks of ``req``."""
    async def body(loop):
        p = puller(LoopPeer(loop), b)
        p.adapter_digest = adapter_digest(b)
        return await p.prepare(req, hint(blocks)), p

    return asyncio.run(with_loop(a, body))


def test_a_pull_under_an_adapter_equals_recompute(tiny_llama_dir, tiny_adapters) -> None:
    store = HostTierStore(TIER_BYTES)
    a, _, a_res = _replica(tiny_llama_dir, tiny_adapters["qv"], store)
    b, rec, b_res = _replica(tiny_llama_dir, tiny_adapters["qv"], store)
    base = prompt(22, seed=71)  # 5 full blocks of 4 + 2 tokens
    run(a, [with_adapter(request(base, max_tokens=2), "qv")])
    again = with_adapter(request(base + prompt(3, seed=72), max_tokens=4), "qv")
    pulled, p = _pull(a, b, again, 5)
    assert p.stats.pulls == 1 and p.stats.pulled_blocks == 5 and not pulled.tier_skip
    assert store.lookup(chain_of(b, again)[:5], [0]) == 5  # under B's chain for qv
    _idle(a)
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 20
    assert restored_blocks(rec, again.request_id) == 5  # never computed on B
    assert lora_error(tiny_llama_dir, tiny_adapters["qv"], rec, again,
                      results[(again.request_id, 0)]) <= 1
    _idle(b)
    store.check_invariants()
    a_res.close()
    b_res.close()


def test_a_holder_at_another_adapter_revision_exports_nothing(tiny_llama_dir,
                                                              tiny_adapters) -> None:
    """A serves ``qv`` at revision 1 (``qv``'s weights), B at revision 2 (``qv2``): B asks for
    its revision-2 hashes, A holds none of them, so nothing is pulled and B recomputes under
    revision 2."""
    store = HostTierStore(TIER_BYTES)
    a, _, a_res = _replica(tiny_llama_dir, tiny_adapters["qv"], store)
    b, rec, b_res = _replica(tiny_llama_dir, tiny_adapters["qv2"], store)
    base = prompt(22, seed=73)
    first = with_adapter(request(base, max_tokens=2), "qv")
    run(a, [first])
    again = with_adapter(request(base + prompt(3, seed=74), max_tokens=3), "qv")
    assert set(chain_of(a, first)[:5]).isdisjoint(chain_of(b, again)[:5])
    pulled, p = _pull(a, b, again, 5)
    assert (p.stats.pulls, p.stats.empty, p.stats.pulled_blocks) == (0, 1, 0)
    assert store.stats().blocks == 0
    _idle(a)
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert restored_blocks(rec, again.request_id) == 0
    assert lora_error(tiny_llama_dir, tiny_adapters["qv2"], rec, again,
                      results[(again.request_id, 0)]) <= 1
    _idle(b)
    a_res.close()
    b_res.close()


def test_a_revision_registered_after_the_pull_never_serves_the_pulled_blocks(
        tiny_llama_dir, tiny_adapters) -> None:
    """B pulls revision 1's blocks, then ``qv`` is re-registered at revision 2 before the
    request is admitted: admission pins revision 2, whose chain the pulled blocks are not
    under; they stay in the tier unused and B recomputes with revision 2's weights."""
    store = HostTierStore(TIER_BYTES)
    a, _, a_res = _replica(tiny_llama_dir, tiny_adapters["qv"], store)
    b, rec, b_res = _replica(tiny_llama_dir, tiny_adapters["qv"], store)
    base = prompt(22, seed=75)
    run(a, [with_adapter(request(base, max_tokens=2), "qv")])
    again = with_adapter(request(base + prompt(3, seed=76), max_tokens=3), "qv")
    pulled, p = _pull(a, b, again, 5)
    assert p.stats.pulled_blocks == 5 and store.stats().blocks == 5
    b_res.register(check_adapter("qv", tiny_adapters["qv2"], b.executor.config, MAX_LORA_RANK))
    results = run(b, [pulled])
    assert results[(again.request_id, 0)].last.usage.cached_prompt_tokens == 0
    assert restored_blocks(rec, again.request_id) == 0 and b.executor.tier.stats.restores == 0
    assert lora_error(tiny_llama_dir, tiny_adapters["qv2"], rec, again,
                      results[(again.request_id, 0)]) <= 1
    _idle(a)
    _idle(b)
    a_res.close()
    b_res.close()


def test_an_adapter_request_is_not_pulled_without_an_adapter_digest(tiny_llama_dir,
                                                                    tiny_adapters) -> None:
    """A puller built for a replica serving no adapter (``adapter_digest`` None) leaves an
    adapter request alone: admission refuses it there (NOT_FOUND), nothing is asked."""
    b, _, _, _ = tier_engine(tiny_llama_dir)
    assert adapter_digest(b) is None
    req = with_adapter(request(prompt(22, seed=77), max_tokens=2), "qv")

    class _Never:
        async def export(self, hint, hashes, timeout_s):
            raise AssertionError("asked a peer for an adapter request")

        async def close(self) -> None:
            pass

    p = puller(_Never(), b)
    assert asyncio.run(p.prepare(req, hint(5))) == req
    assert (p.stats.pulls, p.stats.failed, p.stats.skipped) == (0, 0, 0)
