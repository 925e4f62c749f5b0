"""The engine thread's inbox: what the event loop asks of the engine (new requests, aborts,
failures, exports for a peer, hand-overs, stop), applied on the engine thread in the order it
was asked.

Between steps the engine loop drains it (:meth:`Inbox.drain`). While a step runs, a forward
that may pause between layers (layer-level yield) takes only the new requests out of it
(:meth:`Inbox.take_arrivals`); every other item — and a request whose id an earlier item still
waiting names (its abort applies first, as it was asked first) — waits, in order, for the
step's end. Every item goes through the one ``apply`` the caller gives, whichever path took it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

STOP = None  # the item :meth:`Inbox.stop` puts: the loop ends


class Inbox:
    """A thread-safe FIFO of engine controls (any thread puts; the engine thread applies).

    ``is_arrival(item)``: the request id of an item that may be applied mid-step (a new
    request), else None; ``names(item)``: the request ids an item concerns (``()``: every
    request, e.g. a failure; ``None``: none).
    """

    def __init__(self, is_arrival: Callable[[Any], Optional[str]],
                 names: Callable[[Any], Optional[tuple[str, ...]]]) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._arrived = threading.Event()
        self._deferred: list = []  # taken during a step, not applied: they go first next
        self._is_arrival, self._names = is_arrival, names

    def put(self, item: Any) -> None:
        """Queue ``item`` (any thread)."""
        self._queue.put(item)
        if self._is_arrival(item) is not None:
            self._arrived.set()

    def stop(self) -> None:
        self._queue.put(STOP)

    def empty(self) -> bool:
        """Nothing is queued (what was deferred aside)."""
        return self._queue.empty()

    @property
    def deferred(self) -> int:
        """Items taken during a step that wait for its end."""
        return len(self._deferred)

    def pending(self) -> bool:
        """A new request was put since the last drain or take (one Event read)."""
        return self._arrived.is_set()

    def drain(self, apply: Callable[[Any], None], wait_s: float) -> bool:
        """Apply what was deferred, then everything queued, in order (between steps); wait up
        to ``wait_s`` for a first item when there is none. Returns False once :meth:`stop` was
        seen (the items after it stay queued)."""
        self._arrived.clear()  # what is put from here on is seen by this drain or a take
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            apply(item)
        try:
            item = self._queue.get(timeout=wait_s) if wait_s > 0 and not deferred \
                else self._queue.get_nowait()
        except queue.Empty:
            return True
        while item is not STOP:
            apply(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
        return False

    def take_arrivals(self, apply: Callable[[Any], None]) -> None:
        """Apply the new requests queued so far, mid-step; defer every other item, and a
        request an earlier deferred item names, for :meth:`drain` (in order)."""
        self._arrived.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is STOP:
                self._queue.put(STOP)  # seen by the loop after the step
                return
            rid = self._is_arrival(item)
            if rid is not None and not any(self._concerns(d, rid) for d in self._deferred):
                apply(item)
            else:
                self._deferred.append(item)

    def _concerns(self, item: Any, request_id: str) -> bool:
        names = self._names(item)
        return names is not None and (not names or request_id in names)
