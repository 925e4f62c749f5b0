"""Bounds on a response stream whose reader falls behind (a slow or vanished client).

Every hop that relays a stream (the worker's engine outputs, the router's worker link, the
router's gRPC and HTTP edges) holds at most ``max_unread`` messages of one stream that its
reader has not taken, and waits at most ``stall_s`` for one write to a reader that does not
read (HTTP/2 or TCP flow control holding it). Past either bound the stream is cancelled —
its request aborted, its KV blocks freed — and the hop's other streams go on. The engine
thread only ever hands outputs over; it never waits for a reader.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

from kvfleet.errors import ResourceExhausted

T = TypeVar("T")

DEFAULT_MAX_UNREAD = 1024   # messages (about one per engine step): a few hundred KB at most
DEFAULT_STALL_S = 30.0      # seconds one write may wait for the reader


@dataclass(frozen=True)
class StreamLimits:
    """``max_unread``: messages of one stream buffered for its reader (> 0); ``stall_s``:
    seconds one write may wait for a reader that does not read (> 0).

    Raises:
        ValueError: a bound that is not positive.
    """

    max_unread: int = DEFAULT_MAX_UNREAD
    stall_s: float = DEFAULT_STALL_S

    def __post_init__(self) -> None:
        if not isinstance(self.max_unread, int) or self.max_unread < 1:
            raise ValueError(f"max_unread must be a positive integer, got {self.max_unread!r}")
        if not (self.stall_s > 0 and math.isfinite(self.stall_s)):
            raise ValueError(f"stall_s must be a positive number of seconds, got {self.stall_s!r}")


class SlowReader(ResourceExhausted):
    """A stream was cancelled because its reader fell behind (RESOURCE_EXHAUSTED)."""


async def write_within(write: Awaitable[None], limits: StreamLimits, what: str) -> None:
    """Await one write to a reader (``write``: e.g. ``context.write(msg)``), at most
    ``limits.stall_s``. Raises :class:`SlowReader` naming ``what`` when it takes longer."""
    try:
        async with asyncio.timeout(limits.stall_s):  # a timer, no task: cheap per message
            await write
    except TimeoutError:
        raise SlowReader(f"{what}: the reader took nothing for {limits.stall_s:g} s; "
                         "stream cancelled") from None


_OVERFLOW = object()


class Outbox(Generic[T]):
    """One stream's unread messages (event-loop side), at most ``max_unread``.

    :meth:`put` never blocks. The message past the bound overflows the stream: its backlog
    is dropped, ``on_overflow`` runs once (the owner aborts the request there), later puts
    are ignored and the reader's next :meth:`get` raises :class:`SlowReader` naming ``what``.
    """

    def __init__(self, max_unread: int, on_overflow: Callable[[], None], what: str) -> None:
        self.max_unread = max_unread
        self._on_overflow = on_overflow
        self._what = what
        self._queue: asyncio.Queue = asyncio.Queue()
        self.overflowed = False

    def put(self, item: T) -> None:
        """Hand one message to the reader (on the event loop)."""
        if self.overflowed:
            return
        if self._queue.qsize() >= self.max_unread:
            self.overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(_OVERFLOW)
            self._on_overflow()
            return
        self._queue.put_nowait(item)

    def empty(self) -> bool:
        """No message waits for the reader."""
        return self._queue.empty()

    async def get(self) -> T:
        """The next message. Raises :class:`SlowReader` once the stream overflowed."""
        item = await self._queue.get()
        if item is _OVERFLOW:
            self._queue.put_nowait(_OVERFLOW)  # every later get raises too
            raise SlowReader(f"{self._what}: more than {self.max_unread} messages unread; "
                             "stream cancelled")
        return item
