"""A bounded index of recent outputs, by cache scope: drafts for a sequence may copy what
other requests of the same scope produced (the same agent repeating a tool's output, the same
template filled again).

Isolation follows the prefix cache's rule: a scope is the sequence's block-hash chain root
(model identity, adapter and revision, tenant or named cache scope, cache salt), so one
tenant's outputs never draft another's tokens — drafts are verified, but what is drafted
would still leak through acceptance rates and timing. Memory is bounded by a total token
count over all scopes: the oldest documents go first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class SuffixIndex:
    """Recent token lists (documents) per scope, with an n-gram → latest occurrence map.

    Args:
        max_tokens: tokens kept over every scope together (oldest documents evicted first).
        min_n, max_n: n-gram lengths matched (longest first).

    Raises:
        ValueError: a bound below 1, or ``max_n`` < ``min_n``.
    """

    def __init__(self, max_tokens: int = 1 << 18, min_n: int = 2, max_n: int = 8) -> None:
        if max_tokens < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"suffix index needs max_tokens >= 1 and 1 <= min_n <= max_n, got "
                             f"{max_tokens}, {min_n}, {max_n}")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self._docs: OrderedDict[int, tuple[bytes, tuple[int, ...]]] = OrderedDict()
        self._ends: dict[tuple[bytes, tuple[int, ...]], tuple[int, int]] = {}
        self._next_doc = 0
        self.num_tokens = 0

    def add(self, scope: bytes, tokens: Sequence[int]) -> None:
        """Publish ``tokens`` (a finished sample's verified output, or its prompt and output)
        under ``scope``; evicts the oldest documents past ``max_tokens``."""
        doc = tuple(tokens[-self.max_tokens:])
        if len(doc) < 2:
            return
        doc_id = self._next_doc
        self._next_doc += 1
        self._docs[doc_id] = (scope, doc)
        self.num_tokens += len(doc)
        for key, end in self._ngrams(scope, doc):
            self._ends[key] = (doc_id, end)
        while self.num_tokens > self.max_tokens:
            self._evict()

    def propose(self, scope: bytes, tokens: Sequence[int], k: int) -> tuple[int, tuple[int, ...]]:
        """``(n, draft)``: up to ``k`` tokens that followed the latest occurrence, in
        ``scope``'s documents, of the longest suffix of ``tokens`` (``n`` tokens); ``(0, ())``
        when none matches."""
        if k <= 0:
            return 0, ()
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._ends.get((scope, tuple(tokens[len(tokens) - n:])))
            if hit is not None:
                doc = self._docs[hit[0]][1]
                draft = doc[hit[1] + 1: hit[1] + 1 + k]
                if draft:
                    return n, draft
        return 0, ()

    def check_invariants(self) -> None:
        """Token count matches the documents; no n-gram points at an evicted document."""
        assert self.num_tokens == sum(len(d) for _, d in self._docs.values()), "token count drift"
        assert self.num_tokens <= self.max_tokens, "memory bound exceeded"
        assert all(doc in self._docs for doc, _ in self._ends.values()), "dangling n-gram"

    def _ngrams(self, scope: bytes, doc: tuple[int, ...]):
        for end in range(len(doc) - 1):  # an n-gram at the very end has nothing after it
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                yield (scope, doc[end - n + 1: end + 1]), end

    def _evict(self) -> None:
        doc_id, (scope, doc) = self._docs.popitem(last=False)
        self.num_tokens -= len(doc)
        for key, _ in self._ngrams(scope, doc):
            if self._ends.get(key, (None,))[0] == doc_id:
                del self._ends[key]
