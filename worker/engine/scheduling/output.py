"""What the scheduler hands the engine: a step's plan with its sequences, and the forks of a step.

:class:`SchedulerOutput` wraps the :class:`~kvfleet.worker.engine.step_plan.StepPlan` that
crosses to the model runner with the engine-side view of the same step: which sequences run how
many tokens and which sample, which were preempted to make room, and which restore blocks from
the host tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan

if TYPE_CHECKING:  # annotations only
    from kvfleet.worker.kv_tier.admission import Restore


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's part of a step. ``sample`` is true when the chunk reaches the sequence's
    last known token, so its logits give the next token. ``draft_token_ids``: speculative
    drafts after that token (a decode row only), computed in the same chunk but counted as
    computed only once verified (``num_new_tokens`` does not include them)."""

    seq: SequenceState
    num_new_tokens: int
    sample: bool
    draft_token_ids: tuple[int, ...] = ()

    def chunk(self, block_tables: Sequence[Sequence[int]]) -> SeqChunk:
        """The plan's chunk: the ``num_new_tokens`` tokens after the sequence's computed ones
        (call before they are counted as computed), over its ``block_tables`` (block ids, one
        table per layer group)."""
        start = self.seq.num_computed_tokens
        return SeqChunk(seq_id=self.seq.seq_id,
                        token_ids=(self.seq.token_slice(start, start + self.num_new_tokens)
                                   + self.draft_token_ids),
                        num_computed_tokens=start, block_table=tuple(block_tables[0]),
                        adapter_slot=self.seq.adapter_slot,
                        num_draft_tokens=len(self.draft_token_ids),
                        group_tables=tuple(tuple(t) for t in block_tables[1:]))


@dataclass(frozen=True)
class SchedulerOutput:
    """One planned step: the ``plan`` to execute, its ``scheduled`` sequences in the plan's
    chunk order, the sequences ``preempted`` (by recompute) while planning it, and the host-tier
    ``restores`` it admitted (their blocks are ``plan.block_restores``)."""

    plan: StepPlan
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[SequenceState, ...] = ()
    restores: tuple[Restore, ...] = ()


@dataclass(frozen=True)
class Fork:
    """A sibling that joined the running set after ``leader``'s prompt was computed; it samples
    its first token from the leader's logits of that step."""

    leader: SequenceState
    sibling: SequenceState
