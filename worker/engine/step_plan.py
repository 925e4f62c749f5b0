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
    """

    seq_id: str  # the sequence's id (``<request id>#<sample index>`` in the engine)
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_table: tuple[int, ...]
    adapter_slot: int = 0


@dataclass(frozen=True)
class StepPlan:
    """Chunks to run in one forward, plus block copies (copy-on-write) to do before it.

    ``block_copies`` holds ``(src_block, dst_block)`` pairs: the runner copies every layer's
    K and V of ``src`` into ``dst`` before writing new KV.
    """

    chunks: tuple[SeqChunk, ...]
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
