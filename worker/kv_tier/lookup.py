"""Rank 0's view of the host tier at admission: how many leading blocks of a chain it holds
for every rank of the replica, and a short back-off after a failed restore."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

from kvfleet.worker.kv_tier.store import TierStats, TierStore

log = logging.getLogger(__name__)


class TierLookup:
    """``store`` as the scheduler asks it. After :meth:`mark_down` (a restore failed: the tier's
    actor may be gone) every lookup answers 0 for ``retry_after_s`` seconds, so the steps in
    between recompute rather than wait on a dead actor again."""

    def __init__(self, store: TierStore, tp: int = 1, retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.ranks, self.retry_after_s = store, list(range(tp)), retry_after_s
        self._clock = clock
        self._down_until = 0.0
        self.lookups = self.hits = 0  # calls, and blocks they found
        self.node_stats: Optional[TierStats] = None  # the node tier's, as last refreshed

    def refresh_node_stats(self) -> Optional[TierStats]:
        """Read the node tier's counters (a Ray call when the tier is the node's actor: off
        the engine thread, e.g. from the heartbeat); keeps the last answer on failure."""
        stats = getattr(self.store, "stats", None)
        if stats is None:
            return self.node_stats
        try:
            self.node_stats = stats()
        except Exception as exc:  # a dead or slow tier: the metrics keep their last values
            log.debug("kv tier stats unavailable: %s", exc)
        return self.node_stats

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading ``hashes`` held for every rank (0 while backing off, or on any error)."""
        if not hashes or self._clock() < self._down_until:
            return 0
        self.lookups += 1
        try:
            found = self.store.lookup(list(hashes), self.ranks)
        except Exception as exc:  # a dead or slow tier: recompute, try again later
            log.warning("kv tier lookup failed: %s", str(exc))
            self.mark_down()
            return 0
        self.hits += found
        return found

    def mark_down(self) -> None:
        self._down_until = self._clock() + self.retry_after_s
