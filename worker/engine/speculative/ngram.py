"""Prompt lookup: draft a sequence's next tokens by copying what followed the most recent
earlier occurrence of its last few tokens, in its own prompt and output.

:class:`NgramIndex` keeps, for every n-gram (``min_n ≤ n ≤ max_n``) of one token list, where
it last ended, extended incrementally as tokens are appended: a lookup is a few dict probes,
not a scan. The n-gram that ends at the list's last token is indexed one step late, so a
lookup finds an *earlier* occurrence of the current suffix, never the suffix itself.
"""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """Last end position of every n-gram of one growing token list.

    Args:
        min_n, max_n: n-gram lengths matched (longest first).

    Raises:
        ValueError: ``min_n`` < 1 or ``max_n`` < ``min_n``.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"n-gram lengths need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # n-grams ending before this index are in _ends

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` (the whole list so far: it only grows) that end
        before its last token."""
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._ends[tuple(tokens[end - n + 1: end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """``(n, end)``: the longest suffix of ``tokens`` (``n`` tokens, ``min_n ≤ n ≤
        max_n``) seen before, and where its latest earlier occurrence ends; ``(0, -1)``
        when none is. Call :meth:`extend` with the same list first."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the suffix of
        ``tokens`` (``()`` when there is none)."""
        self.extend(tokens)
        n, end = self.match(tokens)
        if n == 0 or k <= 0:
            return ()
        return tuple(tokens[end + 1: end + 1 + k])
