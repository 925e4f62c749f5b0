"""This router's own dispatches per replica, and how stale each replica's load report is.

A replica reports ``running + waiting`` on its heartbeat (about once a second) and the router
reads the registry every ``refresh_interval_s``, so the report it routes on can count a request
that has since finished: on an idle fleet the replica that served the last request still looks
busy, and a score that weighs load against prefix depth sends the next request of the same
conversation away from its holder. The ledger knows which of *its own* requests the report
still counts: those dispatched before the report was taken (``updated_at``) and finished after
it. ``Candidate.load`` subtracts them; requests of other routers stay as reported.

Times are unix seconds: ``updated_at`` is the worker's clock, dispatch and finish times the
router's. On one host they agree; across hosts a clock offset of δ only misjudges requests that
started or finished within δ of a heartbeat, and the result is clamped to at least this
router's own in-flight count.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Iterable, Optional

from kvfleet.index_keys import ReplicaLoad
from kvfleet.router.tenant_spread import light_counts

MAX_FINISHED = 4096  # finishes kept per replica while its report does not advance (a hung worker)


class InflightLedger:
    """Per replica: open streams (``inflight``) and ``settled(rid)``, the number of this
    router's requests that the replica's current report counts but that have finished; per
    tenant and replica, open streams (``by_tenant``: the tenant-aware spread's counts,
    ``router/tenant_spread.py``)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.inflight: dict[str, int] = defaultdict(int)
        self._report_at: dict[str, float] = {}  # replica → updated_at of the report in use
        # replica → (dispatched, finished) unix s of requests finished after that report
        self._finished: dict[str, list[tuple[float, float]]] = {}
        self._settled: dict[str, int] = {}
        self.by_tenant: dict[str, dict[str, int]] = {}  # tenant → replica → open streams

    def dispatched(self, replica_id: str, tenant: str = "") -> float:
        """A stream of ``tenant`` to ``replica_id`` opened; returns its dispatch time for
        ``finished``."""
        self.inflight[replica_id] += 1
        per = self.by_tenant.setdefault(tenant, {})
        per[replica_id] = per.get(replica_id, 0) + 1
        return self.clock()

    def finished(self, replica_id: str, dispatched_at: float, tenant: str = "") -> None:
        """The stream of ``tenant`` opened at ``dispatched_at`` ended (done, failed or
        cancelled)."""
        self.inflight[replica_id] -= 1
        per = self.by_tenant.get(tenant, {})
        per[replica_id] = per.get(replica_id, 0) - 1
        if per[replica_id] <= 0:  # forgotten at zero: a tenant or replica id may never return
            del per[replica_id]
            if not per:
                self.by_tenant.pop(tenant, None)
        report_at = self._report_at.get(replica_id)
        if report_at is None:
            return  # no report to correct
        now = self.clock()
        if now < report_at:
            return  # the report is newer than this finish (clock offset): it is not counted
        done = self._finished.setdefault(replica_id, [])
        done.append((dispatched_at, now))
        if len(done) > MAX_FINISHED:
            del done[:len(done) - MAX_FINISHED]  # oldest first; it only loses a correction
        if dispatched_at < report_at:
            self._settled[replica_id] = self._settled.get(replica_id, 0) + 1

    def on_reports(self, reports: Iterable[tuple[str, Optional[ReplicaLoad]]]) -> None:
        """The registry was read: recount against each replica's (possibly newer) report."""
        seen = set()
        for rid, load in reports:
            seen.add(rid)
            at = None if load is None else load.updated_at
            if at == self._report_at.get(rid):
                continue
            if at is None:
                self._forget(rid)
                continue
            self._report_at[rid] = at
            kept = [d for d in self._finished.get(rid, ()) if d[1] >= at]
            self._finished[rid] = kept
            self._settled[rid] = sum(1 for started, _ in kept if started < at)
        for rid in [r for r in self._report_at if r not in seen]:
            self._forget(rid)
        for rid in [r for r, n in self.inflight.items() if n == 0 and r not in seen]:
            del self.inflight[rid]  # a replaced replica's id never comes back

    def tenant_spread(self, tenant: str) -> dict[str, int]:
        """``tenant``'s open streams per replica when it is light beside other tenants, else
        ``{}`` (``router/tenant_spread.py``)."""
        mine = self.by_tenant.get(tenant, {})
        others = len(self.by_tenant) - (tenant in self.by_tenant)  # a tenant at zero is dropped
        return light_counts(mine, others, sum(self.inflight.values()))

    def settled(self, replica_id: str) -> int:
        """This router's requests counted by the replica's report that have since finished."""
        return self._settled.get(replica_id, 0)

    def _forget(self, replica_id: str) -> None:
        self._report_at.pop(replica_id, None)
        self._finished.pop(replica_id, None)
        self._settled.pop(replica_id, None)
