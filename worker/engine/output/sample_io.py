"""One sample's output path after a forward: its sampling state, the grammar matcher of a
constrained sample, the incremental detokenizer and the stop-string checker; what one sampled
token makes of them (:meth:`SampleIO.append`), and the sample's last output
(:func:`final_output`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import tokenizers

from kvfleet.constraint import Constraint
from kvfleet.worker.engine.output.detokenizer import IncrementalDetokenizer
from kvfleet.worker.engine.output.masks import RowMatcher
from kvfleet.worker.engine.output.outputs import Milestones, SeqOutput, Timing, TokenLogprobs, Usage
from kvfleet.worker.engine.output.sampling import SampleResult, SampleState, make_generator
from kvfleet.worker.engine.output.stop_checker import StopChecker
from kvfleet.worker.engine.request import FinishReason, SequenceState


@dataclass(frozen=True)
class Appended:
    """What one sampled token made: the text it released, its logprobs, and the finish
    reason when it ended the sample (None: it goes on)."""

    text: str
    logprobs: tuple[TokenLogprobs, ...]
    reason: Optional[FinishReason]


class SampleIO:
    """Per-sample output helpers (``grammar``: the compiled grammar of a constrained sample,
    ``constraint``: what it was compiled from, when known)."""

    def __init__(self, seq: SequenceState, tokenizer: tokenizers.Tokenizer,
                 grammar: Any = None, constraint: Optional[Constraint] = None) -> None:
        self.matcher = RowMatcher(grammar) if grammar is not None else None
        self.constraint = constraint
        self.state = SampleState(
            params=seq.params, index=seq.index, prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=make_generator(seq.params.seed, seq.index),
        )
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
        self.stop = StopChecker(seq.params.stop)

    def append(self, seq: SequenceState, res: SampleResult, now: float,
               eos_token_ids: frozenset[int]) -> Appended:
        """Append sampled ``res`` to ``seq`` at monotonic time ``now``: timing, logprobs,
        text, and whether a stop token or string, the grammar's end or ``max_tokens`` ends it.

        Raises:
            RuntimeError: the token is outside a constrained sample's grammar.
        """
        if self.matcher is not None and not self.matcher.accept(res.token_id):
            raise RuntimeError(f"sampled token {res.token_id} outside the grammar's mask")
        seq.append_token(res.token_id)
        seq.timing.first_token = seq.timing.first_token or now
        seq.timing.last_token = now
        lp: tuple[TokenLogprobs, ...] = ()
        if seq.params.logprobs is not None:
            assert res.logprob is not None, "the sampler sets logprob when logprobs are asked"
            lp = (TokenLogprobs(res.token_id, res.logprob, tuple(res.top_logprobs)),)
        is_stop_token = res.token_id in seq.params.stop_token_ids or (
            res.token_id in eos_token_ids and not seq.params.ignore_eos)
        text, stopped = "", False
        if not is_stop_token:
            text, stopped = self.stop.feed(self.detok.push([res.token_id]))
        reason = None
        if is_stop_token or stopped or (self.matcher is not None and self.matcher.terminated):
            reason = FinishReason.STOP
        elif len(seq.output_token_ids) >= seq.params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None and not stopped:
            text += self.stop.feed(self.detok.flush())[0] + self.stop.flush()
        return Appended(text, lp, reason)


def final_output(seq: SequenceState, reason: FinishReason, error: BaseException | None = None,
                 token_ids: tuple[int, ...] = (), text: str = "",
                 logprobs: tuple[TokenLogprobs, ...] = ()) -> SeqOutput:
    """The last output of ``seq`` (ended for ``reason``): its usage, worker-side timing and
    milestones (monotonic seconds), and the replica's forward seconds its rows took."""
    t = seq.timing
    first = t.first_token or time.monotonic()
    scheduled = t.first_scheduled or first
    timing = Timing(queue_s=scheduled - t.arrival, prefill_s=first - scheduled,
                    decode_s=(t.last_token or first) - first, ttft_s=first - t.arrival,
                    replica_s=seq.replica_s)
    usage = Usage(seq.num_prompt_tokens, seq.num_cached_tokens or 0, len(seq.output_token_ids))
    milestones = Milestones(t.arrival, t.first_scheduled, t.first_token, t.last_token,
                            time.monotonic(), tuple(t.prefill_chunks), seq.spec_drafted,
                            seq.spec_accepted)
    return SeqOutput(seq.request_id, seq.index, token_ids, text, logprobs, reason, usage,
                     timing, error, milestones)
