"""Per-caller bounds on ``Worker.ExportBlocks``: calls per second and block hashes per second.

An export is a cache-membership answer and work on the engine thread (a lookup per hash, a
snapshot per block held), so a caller that reaches the port (a peer replica, or anything
holding its certificate) may ask only so often and so much. Each caller has two token
buckets, refilled continuously and holding one second's worth; a call that finds either short
is refused at once (RESOURCE_EXHAUSTED, retryable: the puller then recomputes) and takes
nothing from the other. Callers are told apart by their authenticated identity, else by their
network address; the least recently seen are forgotten past ``max_callers``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from kvfleet.errors import ResourceExhausted

DEFAULT_CALLS_PER_S = 50.0
DEFAULT_HASHES_PER_S = 32768.0
MAX_CALLERS = 1024


class TokenBucket:
    """``rate`` tokens a second, at most ``rate`` held (one second's burst), full at first."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.tokens, self.at = rate, rate, now

    def refill(self, now: float) -> None:
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def has(self, n: float) -> bool:
        return self.tokens >= n


class ExportLimits:
    """Bounds of ``calls_per_s`` calls and ``hashes_per_s`` hashes per caller (``clock``:
    monotonic seconds).

    Raises:
        ValueError: a rate not above 0.
    """

    def __init__(self, calls_per_s: float = DEFAULT_CALLS_PER_S,
                 hashes_per_s: float = DEFAULT_HASHES_PER_S, max_callers: int = MAX_CALLERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (calls_per_s > 0 and hashes_per_s > 0):
            raise ValueError(f"export rates must be > 0, got {calls_per_s} calls/s and "
                             f"{hashes_per_s} hashes/s")
        self.calls_per_s, self.hashes_per_s = calls_per_s, hashes_per_s
        self.max_callers, self._clock = max_callers, clock
        self._callers: OrderedDict[str, tuple[TokenBucket, TokenBucket]] = OrderedDict()
        self.refused = 0  # calls refused (metrics)

    def take(self, caller: str, num_hashes: int) -> None:
        """Count one call of ``num_hashes`` hashes against ``caller``'s bounds.

        Raises:
            ResourceExhausted: the caller is past either bound (nothing taken).
        """
        now = self._clock()
        buckets = self._callers.pop(caller, None) or (TokenBucket(self.calls_per_s, now),
                                                      TokenBucket(self.hashes_per_s, now))
        self._callers[caller] = buckets
        while len(self._callers) > self.max_callers:
            self._callers.popitem(last=False)
        calls, hashes = buckets
        calls.refill(now)
        hashes.refill(now)
        if not calls.has(1):
            self.refused += 1
            raise ResourceExhausted(f"ExportBlocks: more than {self.calls_per_s:g} calls a "
                                    "second from this caller; retry later")
        if not hashes.has(num_hashes):
            self.refused += 1
            raise ResourceExhausted(f"ExportBlocks: more than {self.hashes_per_s:g} block hashes "
                                    "a second from this caller; retry later")
        calls.tokens -= 1
        hashes.tokens -= num_hashes
