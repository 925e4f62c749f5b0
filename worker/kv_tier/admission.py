"""Admission's host-tier part: which blocks a waiting sequence restores instead of computing,
and what becomes of them once the engine has moved them (or failed to).

The scheduler asks :meth:`TierAdmission.hits` after the device pool: the chain's next blocks,
up to the reuse limit (the prompt's last token is always computed), that the tier holds for
every rank. An admitted sequence's restored blocks are fresh pool blocks at the table
positions after its device hits: :meth:`TierAdmission.admitted` returns them as a
:class:`Restore`, which the step carries (``SchedulerOutput.restores``; their ``(block, hash)``
pairs in ``StepPlan.block_restores``) and the engine restores before the forward. They are
registered in the prefix cache only once their KV is in place (:meth:`TierAdmission.restored`);
if any rank could not restore, :meth:`TierAdmission.undo` puts the sequences back to wait (and
recompute: they skip the tier next time). A replica without a tier has :class:`NoTierAdmission`:
no hits, nothing to restore or write back. Both count the prompt tokens admitted and where their
cached part came from (:class:`HitCounts`) and report the tier's counters
(:meth:`TierAdmission.stats`: what the tier metrics read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from kvfleet.allocator.kv_cache_manager import NULL_BLOCK, KVCacheManager
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.kv_tier.lookup import TierLookup

if TYPE_CHECKING:  # annotations only: the scheduler (and a config's import) stays torch-free
    from kvfleet.worker.kv_tier.rank_tier import NoRankTier, RankTier

Preempt = Callable[[SequenceState], None]


@dataclass
class HitCounts:
    """Prompt tokens admitted and where their cached part came from (the hit rate by tier),
    since the engine started, taken at each sequence's first admission (a sequence sent back
    by a failed tier restore is counted again when it is readmitted)."""

    prompt_tokens: int = 0  # prompt tokens of admitted sequences
    device: int = 0         # of them, reused from the device pool
    host: int = 0           # of them, restored from the node's host tier

    def admitted(self, prompt_tokens: int, device_tokens: int, host_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.device += device_tokens
        self.host += host_tokens

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "device": self.device, "host": self.host}


@dataclass(frozen=True)
class Restore:
    """One admitted sequence's blocks to restore: ``hashes`` into its block table from index
    ``first`` (after its device hits)."""

    seq: SequenceState
    first: int
    hashes: tuple[bytes, ...]


class TierAdmission:
    """The node's host tier as admission sees it, over ``kv`` and the tier's ``lookup``."""

    enabled = True  # evicted blocks are written back, hits restored

    def __init__(self, kv: KVCacheManager, lookup: TierLookup) -> None:
        self.kv, self.lookup = kv, lookup
        self.restored_blocks = 0  # blocks restored into the pool (metrics)

    @property
    def tier_id(self) -> str:
        """The index's name of the node tier ("" when the store has none)."""
        return getattr(self.lookup.store, "tier_id", "")

    @property
    def lookup_ranks(self) -> list[int]:
        """The replica's ranks (a block is in the tier when every one's shard is)."""
        return self.lookup.ranks

    def eviction_log(self) -> Optional[list[tuple[int, bytes]]]:
        """A list for a step's allocations to record evicted blocks in (written back first)."""
        return []

    def hits(self, seq: SequenceState, num_device_blocks: int) -> Optional[tuple[bytes, ...]]:
        """Hashes of the blocks after the device hits that the tier can restore for ``seq``;
        None while its lookup runs off the engine thread (:class:`TierLookup`)."""
        if seq.tier_skip:
            return ()
        limit = max(0, (seq.num_tokens - 1) // self.kv.block_size)
        wanted = seq.block_hashes[num_device_blocks:limit]
        if self.kv.grouped:  # each group's pages, by the per-group hit rule
            each = self.lookup.held_each(seq.seq_id, self.kv.group_keys(wanted))
            if each is None:
                return None
            return tuple(wanted[:self.kv.longest_hit(num_device_blocks, each)])
        held = self.lookup.held(seq.seq_id, wanted)
        return None if held is None else tuple(wanted[:held])

    def admitted(self, seq: SequenceState, num_device_blocks: int, hashes: Sequence[bytes]
                 ) -> Optional[Restore]:
        """``seq`` was admitted with ``hashes`` to restore after its device blocks: the restore
        its step carries (None: nothing to restore)."""
        self.lookup.forget(seq.seq_id)
        if not hashes:
            return None
        if self.kv.grouped:  # sliding pages before the restored prefix's window: not restored
            self.kv.free_out_of_window(seq.seq_id,
                                       (num_device_blocks + len(hashes)) * self.kv.block_size)
        return Restore(seq, num_device_blocks, tuple(hashes))

    def forget(self, seq: SequenceState) -> None:
        """``seq`` ended: its lookup's answer goes."""
        self.lookup.forget(seq.seq_id)

    def wait_lookups(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the lookups running off the engine thread (call only
        when the step has nothing to run); True when none is left."""
        return self.lookup.wait(timeout_s)

    @property
    def lookups_pending(self) -> bool:
        return self.lookup.pending > 0

    def plan_restores(self, restores: Sequence[Restore]) -> tuple[tuple[int, bytes], ...]:
        """``(block, hash)`` of every block of ``restores`` (for the plan)."""
        return tuple(move for r in restores for move in self._moves(r))

    def _moves(self, r: Restore) -> list[tuple[int, bytes]]:
        """``(block, key)`` of each page ``r`` restores: every group's table entries at
        ``r``'s positions, under that group's key, less the holes (a sliding group's pages
        before the window)."""
        out: list[tuple[int, bytes]] = []
        end = r.first + len(r.hashes)
        for g, table in enumerate(self.kv.block_tables(r.seq.seq_id)):
            out += ((b, self.kv.key(g, h))
                    for b, h in zip(table[r.first:end], r.hashes, strict=True) if b != NULL_BLOCK)
        return out

    def restored(self, restores: Sequence[Restore]) -> None:
        """Every rank restored ``restores``: register their blocks in the prefix cache, as
        held by the tier already (their eviction writes nothing back)."""
        pool = self.kv.pool
        for r in restores:
            end = (r.first + len(r.hashes)) * self.kv.block_size
            self.kv.cache_full_blocks(r.seq.seq_id, r.seq.block_hashes, end,
                                      from_token=r.first * self.kv.block_size)
            # A hash another block registered first keeps that block (not from the tier).
            pool.mark_in_tier(b for b, key in self._moves(r) if pool.lookup(key) == b)
            self.restored_blocks += len(r.hashes)

    def undo(self, restores: Sequence[Restore], preempt: Preempt) -> None:
        """``restores`` failed: ``preempt`` each restoring sequence (its blocks are freed; the
        unregistered restore targets go back to the free list) so it recomputes. A miss (the
        tier evicted a block since the lookup) is no outage: the tier stays on for the others
        (a tier that does not answer backs off through its lookups)."""
        for r in restores:
            r.seq.tier_skip = True
            r.seq.num_cached_tokens = None  # counted again at its real admission
            preempt(r.seq)

    def hottest(self, identity: bytes, max_blocks: int) -> list[bytes]:
        """The tier's most recently used blocks written under ``identity``, held for every
        rank (pre-warm). Raises what the store raises (a dead tier)."""
        return self.lookup.store.hottest(identity, self.lookup.ranks, max_blocks)

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """For each of ``keys``, whether the tier holds it for every rank, asked now (pre-warm:
        not counted as an admission lookup). Raises what the store raises (a dead tier)."""
        return list(self.lookup.store.held(list(keys), self.lookup.ranks)) if keys else []

    def refresh_node_stats(self) -> None:
        """Re-read the node tier's counters (a Ray call: off the engine thread)."""
        self.lookup.refresh_node_stats()

    def stats(self, hits: HitCounts, rank_tier: RankTier | NoRankTier) -> dict[str, Any]:
        """``{"prefix_hits": {prompt_tokens, device, host}, "kv_tier": {...}}``: rank 0's
        ``write_backs``, ``dropped_write_backs``, ``restores``, ``failed_restores``,
        ``bytes_written``, ``bytes_restored`` (``rank_tier``), admission's ``lookups`` and
        ``lookup_hits`` (blocks), and the node's ``bytes_used`` / ``capacity_bytes`` once
        read (bytes, integers)."""
        tier: dict[str, Any] = {"lookups": self.lookup.lookups, "lookup_hits": self.lookup.hits}
        tier.update(rank_tier.counters())
        node = self.lookup.node_stats
        if node is not None:
            tier.update(bytes_used=node.bytes_used, capacity_bytes=node.capacity_bytes)
        return {"prefix_hits": hits.as_dict(), "kv_tier": tier}


class NoTierAdmission:
    """A replica without a host tier: no hits, nothing restored or written back."""

    enabled = False
    tier_id = ""
    restored_blocks = 0
    lookup_ranks: list[int] = []

    def eviction_log(self) -> Optional[list[tuple[int, bytes]]]:
        return None  # evicted blocks are simply dropped

    def hits(self, seq: SequenceState, num_device_blocks: int) -> Optional[tuple[bytes, ...]]:
        return ()

    def forget(self, seq: SequenceState) -> None:
        """No lookups."""

    def wait_lookups(self, timeout_s: float) -> bool:
        return True

    lookups_pending = False

    def admitted(self, seq: SequenceState, num_device_blocks: int, hashes: Sequence[bytes]
                 ) -> Optional[Restore]:
        return None

    def plan_restores(self, restores: Sequence[Restore]) -> tuple[tuple[int, bytes], ...]:
        return ()

    def restored(self, restores: Sequence[Restore]) -> None:
        """Nothing was restored."""

    def undo(self, restores: Sequence[Restore], preempt: Preempt) -> None:
        """Nothing was restored."""

    def hottest(self, identity: bytes, max_blocks: int) -> list[bytes]:
        return []

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    def refresh_node_stats(self) -> None:
        """No node tier."""

    def stats(self, hits: HitCounts, rank_tier: RankTier | NoRankTier) -> dict[str, Any]:
        """``{"prefix_hits": {prompt_tokens, device, host}}`` (no ``"kv_tier"``)."""
        return {"prefix_hits": hits.as_dict()}
