"""What the engine hands to the stream layer: one message per sample per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvfleet.worker.engine.request import FinishReason


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timing:
    """Worker-side durations in seconds (one monotonic clock). ``replica_s``: the replica's
    forward seconds the sample's rows took (:mod:`kvfleet.worker.step_cost.share`)."""

    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float
    replica_s: float = 0.0


@dataclass(frozen=True)
class Milestones:
    """Monotonic timestamps (seconds, the worker's clock) of one sample, for tracing.

    ``None`` where the sample never got there (e.g. cancelled while waiting); ``finished`` is
    when the engine ended it; ``prefill_chunks`` holds (step start, prompt tokens computed)
    for each prefill chunk, recompute after preemption included; ``spec_drafted`` /
    ``spec_accepted``: the sample's speculative drafts verified and accepted.
    """

    arrival: float
    first_scheduled: Optional[float]
    first_token: Optional[float]
    last_token: Optional[float]
    finished: float
    prefill_chunks: tuple[tuple[float, int], ...] = ()
    spec_drafted: int = 0  # speculative drafts verified for this sample
    spec_accepted: int = 0  # … and of those accepted


@dataclass(frozen=True)
class SeqOutput:
    """New tokens of one sample from one engine step; the finish fields are set on its last."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: Optional[FinishReason] = None
    usage: Optional[Usage] = None
    timing: Optional[Timing] = None
    error: Optional[BaseException] = field(default=None, compare=False)
    milestones: Optional[Milestones] = field(default=None, compare=False)  # on the last one

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
