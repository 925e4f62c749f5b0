"""Speculative runs beside plain ones: an oracle drafter that proposes a sequence's plain
continuation with planted mistakes (so drafts are accepted, cut short and rejected at every
position), and the comparison of a speculative run with the plain run of the same requests."""

from __future__ import annotations

from typing import Callable

from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.request import SequenceState

Propose = Callable[[SequenceState], tuple[int, ...]]


def oracle(refs: dict[str, list[int]], k: int = 4) -> Propose:
    """A drafter over each sequence's plain tokens ``refs[seq_id]`` (prompt + output): up to
    ``k`` of them after the sequence's end, with a wrong token planted at a position that
    moves with the sequence's length, and a shorter draft now and then."""
    def propose(seq: SequenceState) -> tuple[int, ...]:
        ref = refs.get(seq.seq_id, [])
        n = seq.num_tokens
        d = list(ref[n: n + k])
        if d and n % 3 != 1:
            wrong = n % len(d) if n % 3 == 0 else len(d) - 1
            d[wrong] = (d[wrong] + 1) % 100
        if n % 5 == 0:
            d = d[:1]
        return tuple(d[: max(0, seq.params.max_tokens - len(seq.output_token_ids) - 1)])
    return propose


def use_oracle(engine: Engine, refs: dict[str, list[int]], k: int = 4) -> None:
    """Make ``engine`` (speculation on) draft with :func:`oracle`."""
    assert engine.scheduler.spec.enabled
    engine.scheduler.spec.propose = oracle(refs, k)  # type: ignore[method-assign]


def drafted_chunks(plans, seq_id: str) -> list[int]:
    """Drafts per chunk of ``seq_id`` over ``plans``, those with any."""
    return [c.num_draft_tokens for p in plans for c in p.chunks
            if c.seq_id == seq_id and c.num_draft_tokens]
