"""The typed plan that crosses from the scheduler to the executor (one per engine step).

The scheduler decides, the executor runs it: nothing else crosses this line. A tensor-parallel
executor sends each plan to its other ranks as a diff against the previous one
(:mod:`kvfleet.worker.executor.tp.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's slice of a step: ``len(token_ids)`` new tokens to compute.

    ``token_ids[j]`` sits at absolute position ``num_computed_tokens + j``; its query attends
    to keys ``0 .. num_computed_tokens + j`` of this sequence only. ``block_table`` lists the
    sequence's KV blocks in order and covers every position up to the chunk's last token.
    ``adapter_slot`` is the runner's LoRA slot its tokens use (0 = the base model).

    ``num_draft_tokens`` (speculative decoding): the last ``num_draft_tokens`` of
    ``token_ids`` are proposed, not yet verified, continuations of a decode row; the runner
    returns the logits of the chunk's last ``1 + num_draft_tokens`` positions (0: of its last
    token only). Their K/V is written like any other token's; the engine counts as computed
    only the positions it verifies, so a rejected draft's slots are simply written again.

    With layer groups (:mod:`kvfleet.allocator.layer_groups`) ``block_table`` is group 0's
    table and ``group_tables`` those of groups 1.. (empty for one group); a sliding group's
    table holds ``-1`` for the blocks before its window (released: no query of this chunk
    sees them).
    """

    seq_id: str  # the sequence's id (``<request id>#<sample index>`` in the engine)
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_table: tuple[int, ...]
    adapter_slot: int = 0
    num_draft_tokens: int = 0
    group_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def num_logit_rows(self) -> int:
        """Logits rows the runner returns for this chunk: its last ``1 + num_draft_tokens``."""
        return 1 + self.num_draft_tokens

    def tables(self) -> tuple[tuple[int, ...], ...]:
        """Every layer group's table, group 0 first."""
        return (self.block_table, *self.group_tables)


@dataclass(frozen=True)
class StepPlan:
    """Chunks to run in one forward, plus block copies (copy-on-write) to do before it.

    ``block_copies`` holds ``(src_block, dst_block)`` pairs: the runner copies every layer's
    K and V of ``src`` into ``dst`` before writing new KV.

    With a host tier (:mod:`kvfleet.worker.kv_tier`) the engine moves blocks before it
    executes the plan (:meth:`~kvfleet.worker.executor.base.Executor.transfer_blocks`, on
    every rank): ``block_saves`` lists ``(block, chain hash)`` of cached blocks this step's
    allocations evicted, written back before anything overwrites them; ``block_restores``
    lists ``(block, chain hash)`` of fresh blocks to fill from the tier (the chunks already
    count those tokens as computed).
    """

    chunks: tuple[SeqChunk, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    block_saves: tuple[tuple[int, bytes], ...] = ()
    block_restores: tuple[tuple[int, bytes], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_logit_rows(self) -> int:
        """Rows of the executor's logits for this plan: ``len(chunks)`` without drafts."""
        return sum(c.num_logit_rows for c in self.chunks)

    def logit_offsets(self) -> list[int]:
        """``(len(chunks) + 1,)`` offsets: chunk ``i``'s logits rows are
        ``offsets[i] .. offsets[i + 1] - 1`` (its last token's is ``offsets[i + 1] - 1``)."""
        out = [0]
        for c in self.chunks:
            out.append(out[-1] + c.num_logit_rows)
        return out
