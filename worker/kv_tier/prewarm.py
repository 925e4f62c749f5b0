"""Pre-warm of a new replica: before it serves, restore into its device pool the
blocks its node's host tier holds for its model identity, most recently used first, for at most
a bounded time; its first requests then hit the device pool instead of restoring at admission.

"Hottest" is what the tier can tell: its LRU order (most recently written or read first),
filtered to the blocks written by a replica of this identity (the tag each write-back carries,
:meth:`~kvfleet.worker.kv_tier.store.HostTierStore.hottest`) and held for every rank. The
blocks are registered under the chain hashes they were stored under, so only a request whose
own chain yields those hashes (same identity, tenant scope, salt, tokens) ever matches them.

:func:`prewarm_runs` is the decision alone (pure: the fleet simulator can call it);
:func:`prewarm` runs it on an engine whose thread has not started.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

from kvfleet.worker.engine.engine import Engine

log = logging.getLogger(__name__)
RUN_BLOCKS = 64  # blocks per restore call: one object per run (docs/kv_tier.md, Layout)
OWNER = "prewarm#0"  # the block table holding a run while it is restored


def prewarm_runs(hottest: Sequence[bytes], cached: Callable[[bytes], bool], free_blocks: int,
                 run_blocks: int = RUN_BLOCKS) -> list[list[bytes]]:
    """The restore calls of a pre-warm: ``hottest`` (most recently used first) less the hashes
    already ``cached`` in the pool, at most ``free_blocks`` of them, in runs of at most
    ``run_blocks``, hottest first.

    Raises:
        ValueError: ``run_blocks`` < 1.
    """
    if run_blocks < 1:
        raise ValueError(f"run_blocks must be >= 1, got {run_blocks}")
    wanted = [h for h in hottest if not cached(h)][:max(0, free_blocks)]
    return [wanted[i:i + run_blocks] for i in range(0, len(wanted), run_blocks)]


def prewarm(engine: Engine, seconds: float, run_blocks: int = RUN_BLOCKS,
            clock: Callable[[], float] = time.monotonic) -> int:
    """Restore the tier's hottest blocks of ``engine``'s identity into its free pool blocks,
    run by run, starting no run after ``seconds`` (one restore call is bounded by the tier's
    own timeout). The restored blocks are cached and evictable, the hottest released last
    (the pool evicts them last). Call before the engine thread starts (it uses the pool and
    the executor directly). Returns the blocks restored; any failure ends the pre-warm with
    what was restored so far (the rest is simply not warm). A KV cache with layer groups is
    not pre-warmed (0).
    """
    if seconds <= 0:
        return 0
    kv = engine.kv
    if kv.grouped:  # its pages are per layer group, which the hottest-run plan does not pair
        log.info("kv pre-warm: skipped (the KV cache has layer groups)")
        return 0
    deadline = clock() + seconds
    try:
        hottest = engine.scheduler.tier.hottest(engine.identity_digest, kv.num_free_blocks)
    except Exception as exc:  # a dead or slow tier: start cold
        log.warning("kv pre-warm: the tier did not answer: %s", exc)
        return 0
    runs = prewarm_runs(hottest, lambda h: kv.pool.lookup(h) is not None, kv.num_free_blocks,
                        run_blocks)
    owners: list[str] = []
    try:
        for i, hashes in enumerate(runs):
            if clock() >= deadline:
                break
            owner = _restore(engine, f"{i}{OWNER}", hashes)
            if owner is None:
                break
            owners.append(owner)
    finally:
        for owner in reversed(owners):  # coldest run first: the hottest become most recent
            kv.free(owner)
    return sum(len(r) for r in runs[:len(owners)])


def _restore(engine: Engine, owner: str, hashes: list[bytes]) -> Optional[str]:
    """Restore ``hashes`` into fresh blocks held by ``owner`` and register them; None (the
    blocks back on the free list) if any rank failed."""
    kv = engine.kv
    blocks = kv.allocate_slots(owner, len(hashes) * kv.block_size)
    if blocks is None:
        return None
    try:
        ok = engine.executor.transfer_blocks((), tuple(zip(blocks, hashes, strict=True)))
    except Exception as exc:  # a rank failed: the replica's own checks report it
        log.warning("kv pre-warm: restore failed: %s", exc)
        ok = False
    if not ok:
        kv.free(owner)
        return None
    kv.cache_full_blocks(owner, hashes, len(hashes) * kv.block_size)
    return owner


def prewarm_before_serving(engine: Engine, seconds: float) -> list[bytes]:
    """:func:`prewarm` for a replica that is starting (``seconds`` 0: none), then the hashes
    the pool registered, which the replica publishes to the prefix index once registered (its
    engine thread, which publishes each step's events, has not started yet)."""
    if seconds <= 0 or not engine.scheduler.tier.enabled:
        return []
    start = time.monotonic()
    n = prewarm(engine, seconds)
    log.info("kv pre-warm: %d blocks restored from the node's tier in %.2f s", n,
             time.monotonic() - start)
    stored, _ = engine.kv.take_events()
    return stored
