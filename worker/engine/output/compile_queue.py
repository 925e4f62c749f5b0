"""Grammar compiles dispatched to a few threads, fairly among tenants and bounded per tenant.

A compile cannot be stopped once it runs (xgrammar's compiler is native code; it releases the
GIL, so threads compile side by side), so what one tenant may hold is bounded before it runs:
at most ``tenant_running`` of its compiles run at once and at most ``max_queued`` wait, past
which its new ones are refused (RESOURCE_EXHAUSTED, retryable). Threads that come free go to
the waiting tenants in turn (round robin), so with ``tenant_running`` below the thread count a
tenant whose schemas take minutes holds its own thread, never every thread: another tenant's
schema starts at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvfleet.errors import ResourceExhausted


@dataclass(eq=False)
class CompileJob:
    """One compile of ``tenant``: ``result`` (its value or error), ``started`` (resolved with
    the monotonic second it began on a thread), ``waiters`` (requests awaiting it; kept by the
    caller)."""

    tenant: str
    fn: Callable[[], Any]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiters: int = 0


class CompileQueue:
    """The compile threads of one replica and the tenants' queues in front of them.

    Args:
        threads: compile threads (>= 1).
        tenant_running: compiles one tenant may run at once (1..threads).
        max_queued: compiles one tenant may have waiting for a thread (>= 0).
    """

    def __init__(self, threads: int, tenant_running: int, max_queued: int) -> None:
        self.tenant_running = tenant_running
        self.max_queued = max_queued
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "kvfleet-grammar")
        self._lock = threading.Lock()
        self._free = threads
        self._closed = False
        self._queues: OrderedDict[str, deque[CompileJob]] = OrderedDict()  # tenant -> waiting
        self._running: Counter = Counter()  # tenant -> compiles running

    def submit(self, tenant: str, fn: Callable[[], Any]) -> CompileJob:
        """Queue ``fn`` (a compile) for ``tenant``; it starts when a thread is free and the
        tenant's turn comes.

        Raises:
            ResourceExhausted: ``tenant`` has ``max_queued`` compiles waiting already.
        """
        job = CompileJob(tenant, fn)
        with self._lock:
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
            if len(queue) >= self.max_queued and not self._may_start(tenant):
                if not queue:
                    del self._queues[tenant]
                raise ResourceExhausted(
                    f"tenant {tenant!r} has {self._running[tenant]} structured-output compiles "
                    f"running and {len(queue)} waiting on this replica, its limit; retry")
            queue.append(job)
            self._dispatch()
        return job

    def withdraw(self, job: CompileJob) -> bool:
        """Take ``job`` out of its queue if it has not started (its ``result`` is cancelled);
        True if it was taken out."""
        with self._lock:
            queue = self._queues.get(job.tenant)
            if queue is None or job not in queue:
                return False
            queue.remove(job)
            if not queue:
                del self._queues[job.tenant]
        job.result.cancel()
        return True

    def waiting(self, tenant: str) -> int:
        """Compiles of ``tenant`` waiting for a thread."""
        with self._lock:
            return len(self._queues.get(tenant, ()))

    def close(self) -> None:
        """Stop taking compiles off the queues (a compile in progress finishes)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _may_start(self, tenant: str) -> bool:
        return not self._closed and self._free > 0 and self._running[tenant] < self.tenant_running

    def _dispatch(self) -> None:
        """Start waiting compiles on free threads, tenants in turn. Call with ``_lock`` held."""
        while True:
            tenant = next((t for t in self._queues if self._may_start(t)), None)
            if tenant is None:
                return
            queue = self._queues.pop(tenant)  # to the back of the turn, if it still waits
            job = queue.popleft()
            if queue:
                self._queues[tenant] = queue
            self._free -= 1
            self._running[tenant] += 1
            self._pool.submit(self._run, job)

    def _run(self, job: CompileJob) -> None:
        job.started.set_result(time.monotonic())
        try:
            value = job.fn()
        except BaseException as exc:  # the caller's error (InvalidArgument ...) travels on
            job.result.set_exception(exc)
        else:
            job.result.set_result(value)
        finally:
            with self._lock:
                self._running[job.tenant] -= 1
                if not self._running[job.tenant]:
                    del self._running[job.tenant]
                self._free += 1
                self._dispatch()
