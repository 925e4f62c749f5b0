"""Rank 0's view of the host tier at admission: how many leading blocks of a chain it holds
for every rank of the replica, asked once per waiting sequence, and a short back-off after the
tier failed to answer.

A node tier is a Ray actor, whose calls wait behind other replicas' puts: with ``background``
the lookups run on a thread of their own, never on the engine thread, and admission sees
"not answered yet" (None) until the answer is in; the sequence then waits its turn (the rows
already running are planned as ever). An in-process store answers at once, on the caller's
thread. Either way a sequence's answer is kept until it is admitted or ends, so a sequence that
waits many steps costs one lookup; a lookup changes no recency in the tier (only a restore,
of an admitted sequence, does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence

from kvfleet.worker.kv_tier.store import TierStats, TierStore

log = logging.getLogger(__name__)
Asked = tuple[tuple[bytes, ...], bool]  # (hashes, whether each one's residency is asked)
Answer = int | tuple[bool, ...]  # leading hashes held, or each hash's residency


class TierLookup:
    """``store`` as the scheduler asks it. A lookup that fails (the tier's actor may be gone)
    makes every lookup answer 0 for ``retry_after_s`` seconds, so the steps in between
    recompute rather than ask a dead actor again. ``background``: run lookups on a thread of
    their own (a store whose calls may block)."""

    def __init__(self, store: TierStore, tp: int = 1, retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, background: bool = False) -> None:
        self.store, self.ranks, self.retry_after_s = store, list(range(tp)), retry_after_s
        self._clock = clock
        self._down_until = 0.0
        self.lookups = self.hits = 0  # calls, and blocks they found
        self.node_stats: Optional[TierStats] = None  # the node tier's, as last refreshed
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        # key -> ((hashes, each), answer); key -> (hashes, each) being looked up
        self._answers: dict[str, tuple[Asked, Answer]] = {}
        self._asked: dict[str, Asked] = {}
        self._queue: Optional[queue.SimpleQueue] = queue.SimpleQueue() if background else None
        self._thread: Optional[threading.Thread] = None

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

    def held(self, key: str, hashes: Sequence[bytes]) -> Optional[int]:
        """Leading ``hashes`` held for every rank, as looked up for ``key`` (a sequence) and
        these hashes: asked once, then remembered until :meth:`forget`. None while the
        lookup runs in the background (started by this call when none is). 0 while backing
        off after a failure."""
        return self._ask(key, tuple(hashes), False)  # type: ignore[return-value]

    def held_each(self, key: str, hashes: Sequence[bytes]) -> Optional[tuple[bool, ...]]:
        """:meth:`held`, but whether each of ``hashes`` is held for every rank (layer groups:
        a hit is not one leading run); all False while backing off."""
        return self._ask(key, tuple(hashes), True)  # type: ignore[return-value]

    def _ask(self, key: str, wanted: tuple[bytes, ...], each: bool) -> Answer | None:
        if not wanted or self._clock() < self._down_until:
            return (False,) * len(wanted) if each else 0
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None and answer[0] == (wanted, each):
                return answer[1]
            if self._queue is not None:
                if self._asked.get(key) != (wanted, each):
                    self._asked[key] = (wanted, each)
                    self._start()
                    self._queue.put((key, (wanted, each)))
                return None
        found = self._look(wanted, each)
        with self._lock:
            self._answers[key] = ((wanted, each), found)
        return found

    def _look(self, wanted: tuple[bytes, ...], each: bool) -> Answer:
        return self.lookup_each(wanted) if each else self.lookup(wanted)

    def forget(self, key: str) -> None:
        """Drop ``key``'s answer (admitted or ended); a lookup still running for it is
        discarded when it answers."""
        with self._answered:
            self._answers.pop(key, None)
            if self._asked.pop(key, None) is not None:
                self._answered.notify_all()

    @property
    def pending(self) -> int:
        """Lookups asked and not answered yet."""
        with self._lock:
            return len(self._asked)

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until no lookup is pending; True if none is."""
        with self._answered:
            return self._answered.wait_for(lambda: not self._asked, timeout_s)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._answer, daemon=True,
                                            name="kv-tier-lookup")
            self._thread.start()

    def _answer(self) -> None:
        assert self._queue is not None
        while True:
            key, wanted = self._queue.get()
            with self._lock:
                if self._asked.get(key) != wanted:
                    continue  # forgotten, or asked again for other hashes
            found = self._look(*wanted)
            with self._answered:
                if self._asked.get(key) == wanted:
                    del self._asked[key]
                    self._answers[key] = (wanted, found)
                self._answered.notify_all()

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Ask the store now (blocking): leading ``hashes`` held for every rank (0 while
        backing off, or on any error)."""
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

    def lookup_each(self, hashes: Sequence[bytes]) -> tuple[bool, ...]:
        """Ask the store now (blocking): whether each of ``hashes`` is held for every rank
        (all False while backing off, or on any error)."""
        if not hashes or self._clock() < self._down_until:
            return (False,) * len(hashes)
        self.lookups += 1
        try:
            found = tuple(bool(h) for h in self.store.held(list(hashes), self.ranks))
        except Exception as exc:  # a dead or slow tier: recompute, try again later
            log.warning("kv tier lookup failed: %s", str(exc))
            self.mark_down()
            return (False,) * len(hashes)
        self.hits += sum(found)
        return found

    def mark_down(self) -> None:
        """The tier failed to answer: answer 0 for ``retry_after_s`` seconds."""
        self._down_until = self._clock() + self.retry_after_s
