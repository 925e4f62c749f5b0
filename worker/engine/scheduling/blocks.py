"""Do the free KV blocks allow a sequence in? The block side of the replica's admission policy.

* ``watermark``: the blocks for the tokens a sequence computes this step must fit beside a
  watermark of free blocks (none while nothing runs: an idle replica admits whatever fits).
* ``reserve``: blocks for ``prompt + max_tokens`` of the sequence and its siblings must fit
  beside the growth already promised to the running ones (:meth:`BlockAdmission.reserved`).

Cached blocks that no live sequence references count as free (they are evictable), so
reusing one uses up a free block just like allocating a new one.

With layer groups every group's blocks count; a sliding group's promise stops growing at its
window (:meth:`KVCacheManager.group_max_blocks`, chunks no wider than the step's token budget).
A chunk writes all its tokens before the window moves, so that promise is ``w - 1 + chunk``
positions: under ``reserve`` a sequence's chunks are cut to half the smallest window
(:func:`window_chunk`), which keeps the promise near the window.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from kvfleet.allocator.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvfleet.allocator.units import cdiv
from kvfleet.errors import ResourceExhausted
from kvfleet.worker.engine.request import SequenceState

Forks = Mapping[str, Sequence[SequenceState]]  # leader seq_id -> siblings waiting to fork


def window_chunk(windows: Sequence[int | None], block_size: int, min_chunk: int = 1
                 ) -> int | None:
    """The widest chunk a sequence takes under ``reserve`` when some layer group slides: half
    the smallest window in whole blocks (at least one block and ``min_chunk``), so a sliding
    group's promise, the blocks covering ``w - 1 + chunk`` positions, stays within about
    ``1.5 w`` instead of ``w + max_num_batched_tokens``; None without sliding groups (chunks
    stay as the token budget allows)."""
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return None
    return max(block_size, min_chunk, min(sliding) // 2 // block_size * block_size)


class BlockAdmission:
    """Block counts of one replica's sequences against its KV cache manager.

    Args:
        kv: the replica's KV cache manager.
        policy: ``"watermark"`` or ``"reserve"`` (``SchedulerConfig.policy``).
        watermark: fraction of all blocks kept free under ``watermark`` (0..1).
    """

    def __init__(self, kv: KVCacheManager, policy: str, watermark: float,
                 max_chunk: Callable[[], int] = lambda: 1 << 62, min_chunk: int = 1) -> None:
        self.kv = kv
        self.reserve = policy == "reserve"
        self.watermark_blocks = int(watermark * kv.num_total_blocks)
        self._step_chunk = max_chunk  # the widest chunk a step may give one sequence now
        # Under reserve a sliding group's promise grows with the widest chunk: cap it.
        self.chunk_cap = window_chunk(kv.windows, kv.block_size, min_chunk) if self.reserve else None

    def max_chunk(self) -> int:
        """The widest chunk one sequence computes in a step: the step's token budget, at most
        :attr:`chunk_cap` (reserve with sliding groups)."""
        step = self._step_chunk()
        return step if self.chunk_cap is None else min(step, self.chunk_cap)

    def chunk(self, want: int) -> int:
        """``want`` tokens cut to :attr:`chunk_cap` (what a sequence may ask of one step)."""
        return want if self.chunk_cap is None else min(want, self.chunk_cap)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.kv.block_size)

    def group_blocks(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """Blocks ``n`` samples of one request hold at most, siblings sharing the full prompt
        blocks (each sibling owns the rest, its copy of the partial prompt block included)."""
        total = num_prompt_tokens + max_tokens
        shared = num_prompt_tokens // self.kv.block_size
        need = 0
        for w, per_seq in zip(self.kv.windows, self.kv.group_max_blocks(total, self.max_chunk()),
                              strict=True):
            # A sliding group's siblings may each slide past the shared prompt blocks.
            need += per_seq + (n - 1) * (per_seq - (shared if w is None else 0))
        return need

    def check_can_ever_fit(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Would a request of ``n`` samples fit in all the blocks, alone? Under ``watermark``
        each sample must fit alone (siblings can be preempted and run one after another);
        under ``reserve`` all ``n`` must fit together.

        Raises:
            ResourceExhausted: it needs more blocks than the replica has.
        """
        group = n if self.reserve else 1
        need = self.group_blocks(num_prompt_tokens, max_tokens, group)
        if need > self.kv.num_total_blocks:
            raise ResourceExhausted(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens})"
                f"{f' for n={n} samples' if group > 1 else ''} needs {need} KV blocks of "
                f"{self.kv.block_size} tokens; this replica has {self.kv.num_total_blocks} in total"
            )

    def new_blocks(self, computed: Sequence[int] | ComputedBlocks, num_tokens: int) -> int:
        """Free blocks a sequence takes to hold ``num_tokens`` tokens when ``computed`` (its
        prefix-cache hits, block ids) are reused: new ones plus unreferenced cached ones."""
        unreferenced = sum(1 for b in computed if self.kv.ref_count(b) == 0)
        return (self.blocks_for(num_tokens) - len(computed)) * self.kv.num_groups + unreferenced

    def pending_copy(self, seq: SequenceState) -> int:
        """Blocks to copy before ``seq``'s next token is written: one per layer group whose
        partially filled last block it shares (0 when that token starts a new block)."""
        if seq.num_computed_tokens % self.kv.block_size == 0:
            return 0  # the next token starts a new block
        return self.kv.pending_copies(seq.seq_id)

    def admissible(self, seq: SequenceState, computed: Sequence[int] | ComputedBlocks,
                   num_tokens: int,
                   running: Sequence[SequenceState], forks: Forks, claimed_blocks: int = 0) -> bool:
        """Would admitting ``seq`` (computing up to ``num_tokens``, reusing the cached blocks
        ``computed``) respect the policy, beside ``running`` and the siblings waiting in
        ``forks``, with ``claimed_blocks`` free blocks already promised to others
        (``watermark`` only)?"""
        if self.reserve:
            # Prompt + max_tokens for this one (and its siblings), plus growth already
            # promised to the running ones.
            siblings = len(forks.get(seq.seq_id, ()))
            unreferenced = sum(1 for b in computed if self.kv.ref_count(b) == 0)
            reused = sum(1 for _ in computed)
            need = (self.group_blocks(seq.num_prompt_tokens, seq.params.max_tokens, 1 + siblings)
                    - reused + unreferenced)
            return need + self.reserved(running, forks) <= self.kv.num_free_blocks
        # With nothing running nothing needs room to grow: the watermark must not keep a
        # request that fits out of an idle replica forever.
        watermark = self.watermark_blocks if running else 0
        return (self.new_blocks(computed, num_tokens) + watermark + claimed_blocks
                <= self.kv.num_free_blocks)

    def reserved(self, running: Iterable[SequenceState], forks: Forks) -> int:
        """Blocks promised to ``running`` sequences (and their unforked siblings in ``forks``)
        under ``reserve`` but not yet allocated, pending copy-on-writes included."""
        total = 0
        chunk = self.max_chunk()
        shared = [self.kv.block_size if w is None else 0 for w in self.kv.windows]
        for s in running:
            total += self.kv.blocks_to_grow(s.seq_id, s.max_total_tokens, chunk)
            total += self.pending_copy(s)
            for sib in forks.get(s.seq_id, ()):
                bounds = self.kv.group_max_blocks(sib.max_total_tokens, chunk)
                total += sum(b - (sib.num_prompt_tokens // bs if bs else 0)
                             for b, bs in zip(bounds, shared, strict=True))
        return total
