"""An engine over a small device pool with a host tier, and the request sequence that pushes a
prompt's blocks out of the pool into the tier, then asks for that prompt again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore, TierStore
from tests.unit.worker.engine_harness import (
    BLOCK_SIZE,
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    seq_tokens,
)
from tests.unit.worker.paged_driver import runner_for

POOL_BLOCKS = 12  # 48 tokens: each filler request below evicts what the first one cached
TIER_BYTES = 64 << 20


def tier_engine(model_dir: Path, store: TierStore | None = None, executor=None, tp: int = 1,
                runner=None, num_blocks: int = POOL_BLOCKS, **engine_args):
    """(engine, recorder, rank-0 RankTier, store): a fresh engine of ``num_blocks`` blocks over the
    session's runner (or ``runner``, or a whole ``executor`` with its tier), writing back to
    and restoring from ``store`` (``engine_args``: for make_engine)."""
    store = store if store is not None else HostTierStore(TIER_BYTES)
    if executor is None:
        runner = runner or runner_for(Path(model_dir), block_size=BLOCK_SIZE)
        executor = LocalExecutor(runner, RankTier(store, 0, runner.kv_cache))
    engine, rec = make_engine(model_dir, num_blocks=num_blocks, runner=executor,
                              tier=TierLookup(store, tp), **engine_args)
    if executor.tier.enabled and not executor.tier.tag:
        executor.tier.tag = engine.identity_digest  # as build_engine tags a replica's
    return engine, rec, executor.tier, store


def evict_then_ask_again(engine, tier: RankTier, base: list[int] | EngineRequest,
                         again: EngineRequest, first_tenant: str = "default", flush_ranks=(),
                         between=None) -> dict:
    """Run ``base`` once (its full blocks get cached), two unrelated prompts that evict them
    (written back to the tier), wait for the write-backs, run ``between()`` if given, then run
    ``again``."""
    first = base if isinstance(base, EngineRequest) else dataclasses.replace(
        request(base, max_tokens=2), tenant=first_tenant)
    run(engine, [first])
    run(engine, [request(prompt(40, seed=90), max_tokens=2)])
    run(engine, [request(prompt(40, seed=91), max_tokens=2)])
    assert all(engine.kv.pool.lookup(h) is None for h in chain_of(engine, first)), "not evicted"
    for t in (tier, *flush_ranks):
        assert t.flush(), "write-backs did not finish"
    if between is not None:
        between()
    return run(engine, [again])


def chain_of(engine, req: EngineRequest) -> list[bytes]:
    from kvfleet.allocator.hashing import block_hash_chain, root_hash

    root = root_hash(engine.lora.digest_for(engine.lora.pin(req.adapter)), req.tenant,
                     req.cache_salt)
    return block_hash_chain(root, list(req.prompt_token_ids), engine.kv.block_size)


def restored_blocks(rec, rid: str) -> int:
    """Blocks the plans restored for request ``rid`` (its first chunk's table positions)."""
    chunk = next(c for p in rec.plans for c in p.chunks if c.seq_id == f"{rid}#0")
    blocks = set(chunk.block_table)
    return sum(1 for p in rec.plans for b, _ in p.block_restores if b in blocks)


def parity_error(model_dir: Path, rec, req: EngineRequest, results) -> float:
    res = results[(req.request_id, 0)]
    return reference_error(model_dir, rec, f"{req.request_id}#0", seq_tokens(req, res))
