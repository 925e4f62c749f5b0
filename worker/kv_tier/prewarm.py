"""Pre-warm of a new replica: before it serves, restore into its device pool the
blocks its node's host tier holds for its model identity, most recently used first, for at most
a bounded time; its first requests then hit the device pool instead of restoring at admission.

"Hottest" is what the tier can tell: its LRU order (most recently written or read first),
filtered to the blocks written by a replica of this identity (the tag each write-back carries,
:meth:`~kvfleet.worker.kv_tier.store.HostTierStore.hottest`) and held for every rank. The
blocks are registered under the chain hashes they were stored under, so only a request whose
own chain yields those hashes (same identity, tenant scope, salt, tokens) ever matches them.

With layer groups (window-sized KV) the tier holds pages, each group's under its own key
(:func:`~kvfleet.allocator.kv_cache_manager.group_key`), and a hit needs pages of several
groups at once (:meth:`~kvfleet.allocator.kv_cache_manager.KVCacheManager.longest_hit`). The
tier does not know a block's place in its chain, so pages are paired by block: a block is as
hot as its hottest page, and a group's page of it is restored only where the block's pages of
every group of an equal or wider window are held too (any hit whose window reaches the page
needs those), so no page comes without the partners a hit would read beside it.

:func:`prewarm_runs` and :func:`prewarm_page_runs` are the decision alone (pure: the fleet
simulator can call them); :func:`prewarm` runs it on an engine whose thread has not started.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

from kvfleet.allocator.kv_cache_manager import group_key, split_group_key
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


def prewarm_page_runs(hottest: Sequence[bytes], windows: Sequence[Optional[int]],
                      present: Callable[[bytes], bool], cached: Callable[[bytes], bool],
                      free_blocks: int, run_blocks: int = RUN_BLOCKS) -> list[list[bytes]]:
    """The restore calls of a pre-warm over layer groups of ``windows`` (None: full
    attention): the blocks of ``hottest`` (page keys, most recently used first; a block ranks
    by its hottest page), and of each block the pages not ``cached`` in the pool whose block
    is ``present`` (held by the tier or cached) in every group of an equal or wider window,
    whole blocks while ``free_blocks`` pages last, packed into runs of at most ``run_blocks``
    pages (a block is split only when it has more pages than a run).

    Raises:
        ValueError: ``run_blocks`` < 1.
    """
    if run_blocks < 1:
        raise ValueError(f"run_blocks must be >= 1, got {run_blocks}")
    blocks = list(dict.fromkeys(split_group_key(k)[1] for k in hottest))
    wider = [[g2 for g2, w2 in enumerate(windows) if w2 is None or (w is not None and w2 >= w)]
             for w in windows]
    runs: list[list[bytes]] = []
    left = max(0, free_blocks)
    for h in blocks:
        keys = [group_key(g, h) for g in range(len(windows))]
        have = [present(k) for k in keys]
        pages = [k for g, k in enumerate(keys)
                 if all(have[g2] for g2 in wider[g]) and not cached(k)]
        if len(pages) > left:
            break
        left -= len(pages)
        while pages:
            if not runs or len(runs[-1]) >= run_blocks:
                runs.append([])
            room = run_blocks - len(runs[-1])
            if len(pages) > room and len(pages) <= run_blocks:
                runs.append([])  # the block starts a run of its own: a failed run keeps it whole
                room = run_blocks
            runs[-1] += pages[:room]
            pages = pages[room:]
    return runs


def prewarm(engine: Engine, seconds: float, run_blocks: int = RUN_BLOCKS,
            clock: Callable[[], float] = time.monotonic) -> int:
    """Restore the tier's hottest blocks of ``engine``'s identity into its free pool blocks,
    run by run, starting no run after ``seconds`` (one restore call is bounded by the tier's
    own timeout). The restored blocks are cached and evictable, the hottest released last
    (the pool evicts them last). Call before the engine thread starts (it uses the pool and
    the executor directly). Returns the blocks restored; any failure ends the pre-warm with
    what was restored so far (the rest is simply not warm). With layer groups the count is of
    pages, every group's (:func:`_prewarm_groups`).
    """
    if seconds <= 0:
        return 0
    kv = engine.kv
    deadline = clock() + seconds
    if kv.grouped:
        return _prewarm_groups(engine, deadline, run_blocks, clock)
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
    if not _moved(engine, blocks, hashes):
        kv.free(owner)
        return None
    kv.cache_full_blocks(owner, hashes, len(hashes) * kv.block_size)
    return owner


def _moved(engine: Engine, blocks: Sequence[int], keys: Sequence[bytes]) -> bool:
    """Restore ``keys`` into ``blocks`` on every rank; False if any rank failed."""
    try:
        return engine.executor.transfer_blocks((), tuple(zip(blocks, keys, strict=True)))
    except Exception as exc:  # a rank failed: the replica's own checks report it
        log.warning("kv pre-warm: restore failed: %s", exc)
        return False


def _prewarm_groups(engine: Engine, deadline: float, run_blocks: int,
                    clock: Callable[[], float]) -> int:
    """:func:`prewarm` over layer groups: the plan of :func:`prewarm_page_runs` (one more tier
    call asks which partner pages the tier holds beyond the hottest), each run restored into
    pool pages held until the end, registered under their keys and marked as held by the
    tier; released coldest run first. Returns the pages restored."""
    kv = engine.kv
    tier = engine.scheduler.tier
    try:
        hottest = tier.hottest(engine.identity_digest, kv.num_free_blocks)
        blocks = list(dict.fromkeys(split_group_key(k)[1] for k in hottest))
        keys = kv.group_keys(blocks)
        held = {k for k, ok in zip(keys, tier.held(keys), strict=True) if ok}
    except Exception as exc:  # a dead or slow tier: start cold
        log.warning("kv pre-warm: the tier did not answer: %s", exc)
        return 0
    pool = kv.pool
    runs = prewarm_page_runs(hottest, kv.windows,
                             lambda k: k in held or pool.lookup(k) is not None,
                             lambda k: pool.lookup(k) is not None, kv.num_free_blocks,
                             run_blocks)
    taken: list[list[int]] = []
    try:
        for run in runs:
            if clock() >= deadline:
                break
            pages = pool.allocate(len(run))
            if not _moved(engine, pages, run):
                pool.release(pages)  # unregistered: back on the free list
                break
            # A key another page registered first keeps that page.
            pool.mark_in_tier(p for p, k in zip(pages, run, strict=True) if pool.register(p, k))
            taken.append(pages)
    finally:
        for pages in reversed(taken):  # coldest run first: the hottest become most recent
            pool.release(reversed(pages))
    return sum(len(r) for r in taken)


def prewarm_before_serving(engine: Engine, seconds: float) -> list[bytes]:
    """:func:`prewarm` for a replica that is starting (``seconds`` 0: none), then the hashes
    the pool registered, which the replica publishes to the prefix index once registered (its
    engine thread, which publishes each step's events, has not started yet)."""
    if seconds <= 0 or not engine.scheduler.tier.enabled:
        return []
    start = time.monotonic()
    n = prewarm(engine, seconds)
    log.info("kv pre-warm: %d %s restored from the node's tier in %.2f s", n,
             "pages" if engine.kv.grouped else "blocks",
             time.monotonic() - start)
    stored, _ = engine.kv.take_events()
    return stored
