"""Where a request's TTFT went, on in-process real replicas: worker milestones and tier calls.

:class:`TtftProbe` wraps, for one fleet, the worker telemetry's finish hook (each sample's
:class:`~kvfleet.worker.engine.output.outputs.Milestones`), the engine's ``move_blocks`` (write-backs
and restores before a forward: one call into the node tier's actor per rank) and
``TierLookup.lookup`` (admission's call into the actor). :meth:`TtftProbe.breakdown` then splits
each request's client TTFT (seconds) into:

* ``route_s``: client TTFT − the worker's (router, gRPC, the client's event loop);
* ``queue_s``: worker arrival → first scheduled (waiting behind other sequences' steps; the
  tier calls of the step that admitted it are in here too);
* ``prefill_s``: first scheduled → first token (its chunks and the steps interleaved with them);
* ``tier_s``: of the worker's window (arrival → first token), seconds its engine thread spent
  in tier calls (lookups + block moves, any sequence's), and ``own_restore_s``: the block moves
  of the steps that restored this request's blocks.

Bench-only instrumentation: it patches module attributes while entered and restores them on
exit; every replica must run in this process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import kvfleet.telemetry.worker_spans as worker_spans
import kvfleet.worker.engine.engine as engine_mod
from kvfleet.worker.kv_tier.lookup import TierLookup


@dataclass
class _Replica:
    """Tier-call intervals (start, seconds) of one replica's engine thread."""

    lookups: list[tuple[float, float]] = field(default_factory=list)
    moves: list[tuple[float, float]] = field(default_factory=list)


class TtftProbe:
    """Per-request TTFT breakdown for the replicas of one fleet (see the module doc).

    Use as a context manager around the fleet's traffic, after :meth:`attach`."""

    def __init__(self) -> None:
        self._by_sched: dict[int, str] = {}   # id(Scheduler) -> replica id
        self._by_lookup: dict[int, str] = {}  # id(TierLookup) -> replica id
        self.replicas: dict[str, _Replica] = {}
        self.finals: dict[str, tuple[str, object]] = {}  # worker request id -> (replica, Milestones)
        self.own_restore_s: dict[str, float] = {}        # worker request id -> seconds

    def attach(self, replicas: Sequence) -> "TtftProbe":
        """Learn which engine belongs to which of ``replicas`` (started ``ReplicaServer``s)."""
        for r in replicas:
            rid, sched = r.cfg.replica_id, r.engine.scheduler
            self.replicas[rid] = _Replica()
            self._by_sched[id(sched)] = rid
            if sched.tier.enabled:
                self._by_lookup[id(sched.tier.lookup)] = rid
        return self

    def __enter__(self) -> "TtftProbe":
        probe = self
        self._saved = (worker_spans.WorkerTelemetry.on_finished, engine_mod.move_blocks,
                       TierLookup.lookup)
        on_finished, move_blocks, lookup = self._saved

        def finished(tel, out) -> None:
            if out.milestones is not None:
                probe.finals[out.request_id] = (tel.replica_id, out.milestones)
            on_finished(tel, out)

        def moved(executor, scheduler, out):
            rid = probe._by_sched.get(id(scheduler))
            restoring = [r.seq.request_id for r in out.restores]
            t0 = time.monotonic()
            try:
                return move_blocks(executor, scheduler, out)
            finally:
                dt = time.monotonic() - t0
                if rid is not None:
                    probe.replicas[rid].moves.append((t0, dt))
                for req in restoring:
                    probe.own_restore_s[req] = probe.own_restore_s.get(req, 0.0) + dt

        def looked(tl, hashes):
            t0 = time.monotonic()
            try:
                return lookup(tl, hashes)
            finally:
                rid = probe._by_lookup.get(id(tl))
                if rid is not None:
                    probe.replicas[rid].lookups.append((t0, time.monotonic() - t0))

        worker_spans.WorkerTelemetry.on_finished = finished
        engine_mod.move_blocks = moved
        TierLookup.lookup = looked
        return self

    def __exit__(self, *exc) -> None:
        (worker_spans.WorkerTelemetry.on_finished, engine_mod.move_blocks,
         TierLookup.lookup) = self._saved

    def breakdown(self, client_id: str, client_ttft_s: Optional[float]) -> dict:
        """The split of one request's TTFT (``client_id``: the id the client sent; the worker
        sees ``"<tenant>/<id>"``). Empty when the worker never reported its milestones."""
        wid = next((w for w in self.finals if w.rpartition("/")[2] == client_id), None)
        if wid is None or client_ttft_s is None:
            return {}
        rep, m = self.finals[wid]
        if m.first_token is None or m.first_scheduled is None:
            return {}
        lo, hi = m.arrival, m.first_token
        calls = self.replicas.get(rep, _Replica())
        inside = lambda xs: sum(min(hi, t + d) - max(lo, t) for t, d in xs  # noqa: E731
                                if t < hi and t + d > lo)
        worker_ttft = m.first_token - m.arrival
        return {"route_s": client_ttft_s - worker_ttft,
                "queue_s": m.first_scheduled - m.arrival,
                "prefill_s": m.first_token - m.first_scheduled,
                "chunks": len(m.prefill_chunks),
                "tier_lookup_s": inside(calls.lookups), "tier_move_s": inside(calls.moves),
                "own_restore_s": self.own_restore_s.get(wid, 0.0)}


PARTS = ("route_s", "queue_s", "prefill_s", "tier_lookup_s", "tier_move_s", "own_restore_s")


def tail_profile(rows: Sequence[dict], q: float = 0.9) -> dict:
    """Mean of each part over all ``rows`` (dicts with ``ttft_s`` and :data:`PARTS`), and over
    those at or above the ``q`` quantile of TTFT (the tail). Raises ValueError without rows."""
    rows = [r for r in rows if r.get("queue_s") is not None]
    if not rows:
        raise ValueError("no request with a breakdown")
    cut = sorted(r["ttft_s"] for r in rows)[min(len(rows) - 1, int(len(rows) * q))]
    tail = [r for r in rows if r["ttft_s"] >= cut]
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
    return {"all": {k: mean(rows, k) for k in ("ttft_s", *PARTS)},
            "tail": {k: mean(tail, k) for k in ("ttft_s", *PARTS)}, "tail_n": len(tail)}
