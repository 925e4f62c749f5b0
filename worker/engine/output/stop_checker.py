"""Stop strings over a text stream that arrives in arbitrary pieces.

Semantics: generation stops at the first point of the text where any stop string is complete
(smallest end position; if several end there, the longest, i.e. the one starting first). The
output is the text before that occurrence. This depends only on the whole text, never on how it
was cut into pieces, so a stop string spanning several tokens or pushes is caught the same way.
"""

from __future__ import annotations

from typing import Sequence


class StopChecker:
    """Filters one sample's decoded text; one instance per sample.

    Holds back the longest tail of the text that is a proper prefix of some stop string (at
    most ``max(len(s)) - 1`` characters), so nothing emitted can turn out to be part of a stop.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "empty stop strings are rejected by SamplingParams.validate"
        self._stop = tuple(stop)
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(text safe to emit now, stopped)``.

        On the piece that completes a stop string: the text up to (not including) it and
        ``True``. After that every call returns ``("", True)``.
        """
        if self._stopped:
            return "", True
        if not self._stop:
            return text, False
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            self._stopped = True
            self._held = ""
            return buf[:match], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """End of generation with no stop matched: the held-back tail ("" once stopped)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buf: str) -> int | None:
        """Start of the occurrence that ends first in ``buf`` (longest on ties), or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stop:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[len(buf) - k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stop):
                return k
        return 0
