"""Token masks of constrained rows: :class:`RowMatcher` follows one sample's grammar state;
:func:`mask_logits` fills a batch's masks, one row at a time, and applies them in one call.

Each row's fill is timed in CPU seconds of the engine thread (a neighbour's load does not count
against it): one pathological grammar can make its fill take milliseconds to seconds, which
every co-batched row would wait for each step, so a row over the budget is reported for the
engine to end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvfleet.worker.engine.output.grammar import xgrammar_module


class RowMatcher:
    """One sample's grammar state: the tokens it may take next, advanced token by token.

    The state is a function of the sample's output tokens only, which preemption by recompute
    keeps: a recomputed sequence continues from the same state.
    """

    def __init__(self, compiled: Any) -> None:
        self._m = xgrammar_module().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> float:
        """Write the allowed-token bits of the next token into ``bitmask[row]`` (int32 words).
        Returns the CPU seconds the fill took on this thread."""
        start = time.thread_time()
        self._m.fill_next_token_bitmask(bitmask, row)
        return time.thread_time() - start

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The output is complete and its stop token was taken: nothing more may follow."""
        return bool(self._m.is_terminated())


@dataclass(frozen=True)
class Masked:
    """:func:`mask_logits`' result: the masked ``logits``, and ``over_budget``: ``(row, CPU
    seconds)`` of each row whose fill took longer than the budget (its mask is applied too)."""

    logits: torch.Tensor
    over_budget: tuple[tuple[int, float], ...] = ()


def mask_logits(logits: torch.Tensor, matchers: Sequence[Optional[RowMatcher]],
                budget_s: float = float("inf")) -> Masked:
    """Logits with every constrained row's disallowed tokens at ``-inf``.

    Args:
        logits: (R, V) float, one row per entry of ``matchers``; not modified.
        matchers: the row's matcher, or None for a free row (left exactly as it was).
        budget_s: CPU seconds one row's fill may take; rows past it are listed in
            ``over_budget``.
    Returns:
        ``logits`` itself when no row is constrained, else a float32 (R, V) copy.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return Masked(logits)
    xgr = xgrammar_module()
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)  # (R, ceil(V / 32)) int32
    over = []
    for i in rows:
        took = matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
        if took > budget_s:
            over.append((i, took))
    out = logits.float().clone()
    if out.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, indices=rows)
    else:
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=vocab,
                                        indices=rows, backend="torch_native")
    return Masked(out, tuple(over))
