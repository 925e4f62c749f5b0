"""A replica's prefix-cache hit rate over a sliding window (``kvfleet status``)."""

from __future__ import annotations

import collections
import time
from typing import Optional


class HitWindow:
    """Cached / prompt tokens of the requests that finished in the last ``window_s`` seconds.

    :meth:`record` is the engine loop's finish hook (one call per finished sample; only
    sample 0 counts, so a request of ``n`` samples counts its prompt once).
    """

    def __init__(self, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int, int]] = collections.deque()
        self._prompt = 0
        self._cached = 0

    def record(self, out, now: Optional[float] = None) -> None:
        """Count a finished :class:`~kvfleet.worker.engine.output.outputs.SeqOutput` (others are ignored)."""
        if out.index != 0 or out.usage is None:
            return
        now = time.monotonic() if now is None else now
        self._events.append((now, out.usage.prompt_tokens, out.usage.cached_prompt_tokens))
        self._prompt += out.usage.prompt_tokens
        self._cached += out.usage.cached_prompt_tokens
        self._expire(now)

    def rate(self, now: Optional[float] = None) -> float:
        """Cached over prompt tokens in the window, 0..1 (0 when nothing finished)."""
        self._expire(time.monotonic() if now is None else now)
        return self._cached / self._prompt if self._prompt else 0.0

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            _, prompt, cached = self._events.popleft()
            self._prompt -= prompt
            self._cached -= cached
