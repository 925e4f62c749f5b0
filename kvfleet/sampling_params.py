"""Sampling parameters: defaults and validation shared by the router and the worker.

Defaults are docs/design.md §5's. ``from_proto`` applies them to unset proto3 ``optional`` fields
and raises :class:`~kvfleet.errors.InvalidArgument` naming the offending field.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Optional

from kvfleet.errors import InvalidArgument, OutOfRange

DEFAULT_MAX_TOKENS = 256
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


def check_context_length(total_tokens: int, max_context: int, what: str,
                         field: Optional[str] = None) -> None:
    """The one context-length rule (router, engine admission, model runner): ``total_tokens``
    positions (prompt + tokens to generate, or computed + chunk) must fit ``max_context``
    (positions ``0 .. max_context - 1``). ``what`` says how the total was made, e.g.
    ``"prompt (250 tokens) + sampling.max_tokens (10)"``.

    Raises:
        OutOfRange: ``total_tokens > max_context``; the message names ``what``, the last
            position and the limit, ``field`` the request field at fault.
    """
    if total_tokens > max_context:
        raise OutOfRange(f"{what} = {total_tokens} tokens: position {total_tokens - 1} is past "
                         f"the context of {max_context} tokens", field=field)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling controls, all defaulted and validated.

    ``temperature == 0`` means greedy. ``seed`` is always concrete after :meth:`from_proto`
    (a random one is drawn when unset) so a sample can be reproduced from its response.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    # False opts this request out of the replica's speculative decoding (the answer is the
    # same either way; only its speed differs).
    speculative: bool = True

    def validate(self) -> "SamplingParams":
        """Check every bound; returns self. Raises InvalidArgument naming the field."""

        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"sampling.{name} {why}", field=f"sampling.{name}")

        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"must be finite, got {getattr(self, name)}")
        if self.max_tokens <= 0:
            raise bad("max_tokens", f"must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        return self

    def check_vocab(self, vocab_size: int) -> "SamplingParams":
        """Check token ids against the served model's vocabulary; returns self.

        Raises:
            InvalidArgument: a ``stop_token_ids`` entry outside ``[0, vocab_size)``.
        """
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"sampling.stop_token_ids: {bad[0]} is outside [0, {vocab_size})",
                                  field="sampling.stop_token_ids")
        return self

    @classmethod
    def from_proto(cls, msg) -> "SamplingParams":
        """Build from a ``kvfleet.v1.SamplingParams`` message, defaulting unset fields.

        Raises:
            InvalidArgument: a field is out of bounds (the message names it).
        """
        kw: dict = {}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "n", "ignore_eos",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                     "speculative"):
            if msg.HasField(name):
                kw[name] = getattr(msg, name)
        kw["seed"] = msg.seed if msg.HasField("seed") else secrets.randbits(63)
        kw["stop"] = tuple(msg.stop)
        kw["stop_token_ids"] = tuple(msg.stop_token_ids)
        return cls(**kw).validate()

    def to_proto(self, msg) -> None:
        """Fill a ``kvfleet.v1.SamplingParams`` message with every field set explicitly."""
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "speculative"):
            setattr(msg, name, getattr(self, name))
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        msg.stop.extend(self.stop)
        msg.stop_token_ids.extend(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
