"""Runs the :class:`Engine` on its own thread and bridges it to asyncio.

The gRPC handlers (on the event loop) submit requests, aborts, exports and hand-overs through
one inbox (:mod:`.inbox`); the engine thread applies them, in the order they were submitted,
through one method (:meth:`EngineLoop._apply`) between steps — new requests also in the middle
of a step whose forward pauses between layers — runs steps while there is work, and hands each
output to the request's :class:`~kvfleet.stream_limits.Outbox` with ``call_soon_threadsafe``. The event
loop never blocks on a forward, and the engine thread never waits for a reader: a request
whose reader leaves more than ``max_unread`` outputs untaken is aborted (its blocks freed).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from dataclasses import dataclass
from typing import AsyncGenerator, Callable, Optional

from kvfleet.errors import Unavailable
from kvfleet.stream_limits import DEFAULT_MAX_UNREAD, Outbox
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.kv_tier.rank_tier import Saved
from kvfleet.worker.service.inbox import Inbox

log = logging.getLogger(__name__)

# Called on the engine thread after a step that stored or evicted blocks:
# (stored hashes, removed hashes, stats snapshot).
StepHook = Callable[[list[bytes], list[bytes], dict], None]


@dataclass
class _Add:
    req: EngineRequest
    out: Outbox
    admitted: asyncio.Future


@dataclass
class _Abort:
    request_id: str
    reason: FinishReason


@dataclass
class _FailAll:
    error: BaseException


@dataclass
class _Export:
    hashes: tuple[bytes, ...]
    done: asyncio.Future


@dataclass
class _HandOver:
    max_blocks: int
    timeout_s: float
    done: asyncio.Future


def _arrival(item) -> Optional[str]:
    """The request id of an inbox item that may be applied mid-step (a new request)."""
    return item.req.request_id if isinstance(item, _Add) else None


def _names(item) -> Optional[tuple[str, ...]]:
    """The requests an inbox item ends: one (an abort), all (``()``: a failure), or none."""
    if isinstance(item, _Abort):
        return (item.request_id,)
    return () if isinstance(item, _FailAll) else None


class EngineLoop:
    """Thread-safe, asyncio-facing wrapper of one :class:`Engine`."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                 on_step: Optional[StepHook] = None,
                 on_finish: Optional[Callable[[SeqOutput], None]] = None,
                 max_unread: int = DEFAULT_MAX_UNREAD) -> None:
        self.engine = engine
        self.max_unread = max_unread  # outputs of one request its reader may leave untaken
        self.loop = loop
        self.on_step = on_step
        # Called on the event loop with every sample's last output, read by a stream or not
        # (telemetry: a cancelled request's finish still reaches it).
        self.on_finish = on_finish
        self._inbox = Inbox(_arrival, _names)
        self._streams: dict[str, Outbox] = {}
        self._stop = threading.Event()
        self._stats: dict = engine.stats()
        # Set by fail(): every request then ends, and every new one is refused, with it.
        self.failure: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.stop()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """The engine thread runs (False before :meth:`start` and after it died or stopped)."""
        return self._thread.is_alive()

    @property
    def stats(self) -> dict:
        """Last stats snapshot taken by the engine thread (running, waiting, blocks)."""
        return dict(self._stats)

    async def generate(self, req: EngineRequest) -> AsyncGenerator[SeqOutput, None]:
        """Submit a request and yield its outputs until every sample has finished.

        Raises a :class:`~kvfleet.errors.KvfleetError` before the first output if refused,
        and :class:`~kvfleet.stream_limits.SlowReader` once the consumer left more than
        ``max_unread`` outputs untaken (the request is aborted then). If the consumer stops
        iterating (client cancelled), the request is aborted.
        """
        if self.failure is not None:
            raise copy.copy(self.failure)  # a fresh traceback per refusal, not one growing
        out: Outbox = Outbox(self.max_unread, lambda: self.abort(req.request_id),
                             f"request {req.request_id}")
        admitted = self.loop.create_future()
        self._inbox.put(_Add(req, out, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            # Cancelled before admission was confirmed: the engine may admit it anyway, and the
            # abort (queued after the add) then ends it at once.
            self.abort(req.request_id)
            raise
        remaining = req.params.n
        try:
            while remaining:
                item = await out.get()
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.abort(req.request_id)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Ask the engine thread to end a request at its next step boundary."""
        self._inbox.put(_Abort(request_id, reason))

    async def hand_over(self, max_blocks: int, timeout_s: float) -> int:
        """Run :meth:`Engine.hand_over` on the engine thread at its next step boundary;
        returns the blocks handed over (0 if it failed: a drain goes on regardless)."""
        done = self.loop.create_future()
        self._inbox.put(_HandOver(max_blocks, timeout_s, done))
        try:
            return await asyncio.wait_for(done, timeout_s + 1.0)
        except Exception:
            log.exception("kv hand-over failed")
            return 0

    async def export_blocks(self, hashes: tuple[bytes, ...], timeout_s: float) -> tuple[bytes, ...]:
        """Export the leading run of ``hashes`` held in the pool to the node's host tier for a
        peer (:meth:`Engine.export_blocks`), and wait, at most ``timeout_s`` in all, for the
        export's own puts (not for other write-backs). Returns the hashes exported (in
        order): the leading run of them in the tier for every rank by then (a dropped
        write-back, a put that failed or is late, lands nothing). No thread waits meanwhile
        (under tensor parallelism the other ranks' shards are looked up, each a short call).

        Raises:
            FailedPrecondition: no host tier. TimeoutError: the engine thread did not take
                the export within ``timeout_s``.
            Unavailable: the engine thread is not running (nothing would answer).
        """
        if not self.alive:
            raise Unavailable("the engine thread is not running: no export")
        deadline = self.loop.time() + timeout_s
        done = self.loop.create_future()
        self._inbox.put(_Export(hashes, done))
        exported, saved = await asyncio.wait_for(done, timeout_s)
        if not exported:
            return ()
        exported = exported[:await own_puts(saved, max(0.0, deadline - self.loop.time()))]
        ranks = self.engine.scheduler.tier.lookup_ranks
        if exported and len(ranks) > 1:
            exported = exported[:await every_rank(self.engine.executor.tier, exported, ranks,
                                                  deadline, self.loop)]
        return exported

    def fail(self, error: BaseException) -> None:
        """The replica can no longer compute (a tensor-parallel rank died): end every request
        with ``error`` at the next step boundary and refuse new ones (any thread)."""
        self.failure = error
        self._inbox.put(_FailAll(error))

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_work)
            if self._stop.is_set():
                break
            try:
                outputs = self.engine.step(self)
            except Exception:  # never let the loop die silently: fail everything in flight
                log.exception("engine step failed; aborting all requests")
                outputs = []
                for rid in list(self._streams):
                    outputs += self.engine.abort(rid, FinishReason.ERROR)
            self._deliver(outputs)
            self._after_step()

    def _drain_inbox(self, block: bool) -> None:
        self._inbox.drain(self._apply, 0.5 if block else 0.0)

    def _apply(self, item) -> None:
        """Apply one inbox item (engine thread): the only place any of them takes effect."""
        if isinstance(item, _Add):
            self._add(item)
        elif isinstance(item, _Abort):
            self._deliver(self.engine.abort(item.request_id, item.reason))
        elif isinstance(item, _FailAll):
            for rid in list(self._streams):
                self._deliver(self.engine.abort(rid, FinishReason.ERROR, item.error))
        elif isinstance(item, _HandOver):
            self._hand_over(item)
        elif isinstance(item, _Export):
            self._export(item)

    # ---- Arrivals (yield_step.py): called by the engine in the middle of a step ------------
    def pending(self) -> bool:
        """A request was submitted since the last :meth:`take` (one Event read)."""
        return self._inbox.pending()

    def take(self) -> None:
        """Add the requests submitted so far; every other inbox item (abort, fail, export,
        hand-over, stop) waits in order for the step's end, and so does a request whose id an
        earlier deferred abort names (the abort applies first, as the inbox ordered)."""
        self._inbox.take_arrivals(self._apply)

    def emit(self, outputs: list[SeqOutput]) -> None:
        """Deliver a nested step's outputs now."""
        self._deliver(outputs)

    def _hand_over(self, item: _HandOver) -> None:
        try:
            n = self.engine.hand_over(item.max_blocks, item.timeout_s)
        except Exception as exc:
            self.loop.call_soon_threadsafe(_set_exception, item.done, exc)
            return
        self.loop.call_soon_threadsafe(_set_result, item.done, n)

    def _export(self, item: _Export) -> None:
        def done(hashes: tuple[bytes, ...]) -> None:
            # Rank 0's puts of this export, read right after its transfer (engine thread).
            saved = self.engine.executor.tier.last_saved if hashes else Saved()
            self.loop.call_soon_threadsafe(_set_result, item.done, (hashes, saved))

        try:
            self.engine.export_blocks(item.hashes, done)
        except Exception as exc:
            self.loop.call_soon_threadsafe(_set_exception, item.done, exc)

    def _add(self, item: _Add) -> None:
        try:
            if self.failure is not None:
                raise copy.copy(self.failure)
            self.engine.add_request(item.req)
        except Exception as exc:
            self.loop.call_soon_threadsafe(_set_exception, item.admitted, exc)
            return
        self._streams[item.req.request_id] = item.out
        self.loop.call_soon_threadsafe(_set_result, item.admitted, None)

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        ended = set()
        for o in outputs:
            if o.finished and self.on_finish is not None:
                self.loop.call_soon_threadsafe(self.on_finish, o)
            q = self._streams.get(o.request_id)
            if q is None:
                continue
            self.loop.call_soon_threadsafe(q.put, o)
            if o.finished and not self.engine.is_active(o.request_id):
                ended.add(o.request_id)
        # After the loop: n samples that finish in one step each still need their output.
        for request_id in ended:
            self._streams.pop(request_id, None)

    def _after_step(self) -> None:
        self._stats = self.engine.stats()
        stored, removed = self.engine.kv.take_events()
        if self.on_step is not None and (stored or removed):
            try:
                self.on_step(stored, removed, self._stats)
            except Exception:
                log.exception("step hook failed")


LANDED_POLL_S = 0.005  # between looks at the other ranks' shards of an export


async def own_puts(saved: Saved, timeout_s: float) -> int:
    """Wait at most ``timeout_s`` for ``saved``'s runs (no thread waits: each completion
    wakes the event loop); the leading blocks that landed."""
    waits = [asyncio.wrap_future(done) for done in saved.completions]
    if waits:
        await asyncio.wait(waits, timeout=timeout_s)
    landed = 0
    for wait, size in zip(waits, saved.sizes, strict=True):
        if not (wait.done() and not wait.cancelled() and wait.result()):
            break
        landed += size
    for wait in waits:
        wait.cancel()  # those still waiting: nobody reads them
    return landed


async def every_rank(tier, exported: tuple[bytes, ...], ranks: list[int], deadline: float,
                     loop: asyncio.AbstractEventLoop) -> int:
    """The leading ``exported`` blocks the tier holds for every rank in ``ranks``, looked up
    until all are in or ``deadline`` (the other ranks' writers put their shards on their
    own); 0 when the tier does not answer."""
    while True:
        try:
            held = await asyncio.to_thread(tier.store.lookup, list(exported), ranks)
        except Exception as exc:  # a dead or slow tier: nothing is known to have landed
            log.warning("kv tier lookup of an export failed: %s", exc)
            return 0
        if held >= len(exported) or loop.time() >= deadline:
            return held
        await asyncio.sleep(LANDED_POLL_S)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
