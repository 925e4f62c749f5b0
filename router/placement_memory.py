"""What this router sent where, recently: blocks the prefix index may not show yet, and each
replica's KV working set.

1. **Index lag.** A replica publishes a block once its prefill has computed it (one engine step
   after the chunk runs, behind whatever queue it has), so for a second or more after a request
   is sent its prefix is in no index. A second request of the same prefix in that window sees no
   holder and is placed as a new family: two replicas compute the prefix, hold it, and split
   its traffic. ``matched`` counts the blocks sent within ``horizon`` decisions as held.
   (SGLang's cache-aware router keeps a whole approximate tree of what it sent where; here the
   index stays the truth once it has caught up.)
2. **Working set.** ``working_set`` is the number of distinct blocks sent to a replica within
   the last ``window`` decisions: the KV its traffic needs resident to hit. A replica whose
   working set exceeds its KV evicts blocks its own traffic comes back for (a thrash), so a new
   prefix belongs where the working set has the most room — not where the load happens to be
   lowest at the moment it first arrives.

Chained hashes make the blocks sent to a replica prefix-closed (a block sent implies its
whole prefix was sent with it), so ``matched`` bisects.
"""

from __future__ import annotations

from typing import Sequence


class PlacementMemory:
    """``block hash → {replica_id: decision}`` over the last ``window`` decisions."""

    def __init__(self, horizon: int, window: int) -> None:
        if not 1 <= horizon <= window:
            raise ValueError(f"need 1 <= horizon <= window, got {horizon}, {window}")
        self.horizon, self.window = horizon, window
        self._sent: dict[bytes, dict[str, int]] = {}
        self._held: dict[str, int] = {}  # replica → blocks with an entry in _sent
        self._pruned_at = 0

    def record(self, chain: Sequence[bytes], replica_id: str, decision: int) -> None:
        """Note that ``chain``'s blocks were sent to ``replica_id`` at ``decision`` (a
        non-decreasing counter); forgets entries older than ``window`` now and then."""
        for h in chain:
            by = self._sent.setdefault(h, {})
            if replica_id not in by:
                self._held[replica_id] = self._held.get(replica_id, 0) + 1
            by[replica_id] = decision
        if decision - self._pruned_at >= max(1, self.window // 8):
            self._prune(decision - self.window)
            self._pruned_at = decision

    def _prune(self, oldest: int) -> None:
        for h in list(self._sent):
            by = self._sent[h]
            for rid in [r for r, d in by.items() if d < oldest]:
                del by[rid]
                self._held[rid] -= 1
            if not by:
                del self._sent[h]

    def matched(self, chain: Sequence[bytes], replica_id: str, decision: int) -> int:
        """Leading blocks of ``chain`` sent to ``replica_id`` in the ``horizon`` decisions
        before ``decision`` (0 if none)."""
        lo, hi = 0, len(chain)  # invariant: the first lo blocks were sent; none past hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = self._sent.get(chain[mid - 1], {}).get(replica_id)
            if at is not None and decision - at <= self.horizon:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def working_set(self, replica_id: str) -> int:
        """Distinct blocks sent to ``replica_id`` within about the last ``window`` decisions
        (entries up to ``window // 8`` decisions older linger until the next prune)."""
        return self._held.get(replica_id, 0)
