"""Verifying a step's drafts against its logits: what each row emits.

Round ``j`` samples position ``j`` of every row still verifying (round 0: every sampled row,
drafts or not), each with its own sampler state, so penalties see the tokens emitted in the
rounds before and a seeded generator advances once per emitted token. A row stays for round
``j + 1`` while its token at ``j`` equals its ``j``-th draft and nothing ended it.

Why this is exact. Greedy: each emitted token is the argmax of the logits of the sequence's
own (verified) tokens — the plain path's token. Random: the token at each position is drawn
from the model's distribution ``p`` exactly as without drafts (one uniform, inverse CDF), and
a point-mass draft ``d`` is accepted iff that draw is ``d``: with probability ``p(d)``, and
on rejection the draw is distributed as ``p`` with ``d`` removed and renormalised — the
rejection-sampling rule for a draft-free (point-mass) proposal, realised as a coupling. So
the output distribution is the model's, and a seeded request gives the same tokens with
speculation on or off (up to float noise in the logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from kvfleet.worker.engine.output.outputs import TokenLogprobs
from kvfleet.worker.engine.output.sample_io import Appended
from kvfleet.worker.engine.output.sampling import SampleResult
from kvfleet.worker.engine.request import FinishReason, SequenceState


@dataclass
class Emitted:
    """What one row emits this step: tokens, their text and logprobs, how many drafts were
    accepted, and the finish reason or error when one ended it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    accepted: int = 0
    reason: Optional[FinishReason] = None
    error: Optional[BaseException] = None


class Verification:
    """The rounds of one step's sampling (see the module docstring).

    Args:
        seqs: the rows that sample this step.
        drafts: each row's drafts (``()``: a plain row, one round).
    """

    def __init__(self, seqs: Sequence[SequenceState], drafts: Sequence[tuple[int, ...]]) -> None:
        assert len(seqs) == len(drafts)
        self.drafts = drafts
        self.emitted = [Emitted() for _ in seqs]
        self.round = -1
        self._next: list[int] = list(range(len(seqs)))

    def live(self) -> list[int]:
        """The rows to sample in the next round (empty: done); advances :attr:`round`."""
        live, self._next = self._next, []
        self.round += 1
        return live

    def add(self, i: int, res: SampleResult, got: Appended) -> None:
        """Row ``i`` emitted ``res`` (appended to its sequence as ``got``) this round."""
        e = self.emitted[i]
        e.token_ids.append(res.token_id)
        e.text += got.text
        e.logprobs += got.logprobs
        e.reason = got.reason
        j = self.round
        if got.reason is None and j < len(self.drafts[i]) and res.token_id == self.drafts[i][j]:
            e.accepted += 1
            self._next.append(i)

    def fail(self, i: int, error: BaseException) -> None:
        """Row ``i``'s post-processing raised ``error``: it ends with it."""
        self.emitted[i].error = error
