"""What a replica reports to Ray Serve's autoscaler every metrics interval (the Serve
deployment's ``record_autoscaling_stats``; the signals are named in
:mod:`kvfleet.worker.replica.autoscale`).

The predicted queue delay is the engine's own forecast (``Engine.stats()["queue_delay_s"]``,
:mod:`kvfleet.worker.step_cost.queue_delay` over the replica's calibrated step-cost model): the
number routers route on is the one the autoscaler scales on.
"""

from __future__ import annotations

import collections
import time
import zlib
from typing import Any, Iterable, Mapping, Optional

from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.replica import autoscale as a


class LatencyWindow:
    """TTFT and inter-token latency of the requests that finished in the last ``window_s``
    seconds (sample 0 of each; ITL = decode time / (output tokens - 1)). Fed by the engine
    loop's finish hook, read by the load report."""

    def __init__(self, window_s: float = a.LATENCY_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._events: collections.deque[tuple[float, float, Optional[float]]] = collections.deque()

    def record(self, out, now: Optional[float] = None) -> None:
        """Count a finished :class:`~kvfleet.worker.engine.output.outputs.SeqOutput` (others ignored)."""
        if out.index != 0 or out.timing is None or out.usage is None or not out.usage.completion_tokens:
            return
        n = out.usage.completion_tokens
        self.add(out.timing.ttft_s, out.timing.decode_s / (n - 1) if n > 1 else None, now)

    def add(self, ttft_s: float, itl_s: Optional[float], now: Optional[float] = None) -> None:
        """Count one finished request's TTFT and ITL (None: one output token) at ``now``."""
        now = time.monotonic() if now is None else now
        self._events.append((now, ttft_s, itl_s))
        self._expire(now)

    def p90(self, now: Optional[float] = None) -> tuple[float, float]:
        """(TTFT p90, ITL p90) in seconds over the window; 0.0 where nothing finished."""
        self._expire(time.monotonic() if now is None else now)
        ttft = [e[1] for e in self._events]
        itl = [e[2] for e in self._events if e[2] is not None]
        return _p90(ttft), _p90(itl)

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


def _p90(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def revision_id(revision: str) -> float:
    """A revision label as a number Serve's metrics can carry (crc32)."""
    return float(zlib.crc32(revision.encode()))


def replica_report(stats: Mapping[str, Any], sched: SchedulerConfig, latency: LatencyWindow,
                   hit_rate: float, revision: str = "",
                   now: Optional[float] = None) -> dict[str, float]:
    """One replica's signals (:data:`kvfleet.worker.replica.autoscale.SIGNALS`); ``now``:
    the latency window's clock (default: monotonic)."""
    total = int(stats.get("num_total_blocks", 0))
    ttft, itl = latency.p90(now)
    return {
        a.KV_BLOCKS_USED: float(total - int(stats.get("num_free_blocks", 0))),
        a.KV_BLOCKS_TOTAL: float(total),
        a.WAITING: float(stats.get("waiting", 0)),
        a.RUNNING: float(stats.get("running", 0)),
        a.PREFILL_TOKENS_QUEUED: float(stats.get("prefill_tokens_queued", 0)),
        a.QUEUE_DELAY_S: float(stats.get("queue_delay_s") or 0.0),
        a.TTFT_P90_S: ttft,
        a.ITL_P90_S: itl,
        a.PREFIX_HIT_RATE: hit_rate,
        a.MAX_NUM_SEQS: float(sched.max_num_seqs),
        a.REVISION_ID: revision_id(revision),
        a.THROUGHPUT_LOAD: float(stats.get("throughput_load") or 0.0),
    }


_SUMMED = (a.KV_BLOCKS_USED, a.KV_BLOCKS_TOTAL, a.WAITING, a.RUNNING, a.PREFILL_TOKENS_QUEUED,
           a.MAX_NUM_SEQS)


def combine(reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The report of a process hosting several replicas (cost-model hosts): counts summed,
    delays and latencies the worst, hit rate and throughput load the mean. Raises ValueError
    when empty."""
    rows = list(reports)
    if not rows:
        raise ValueError("no replica reports to combine")
    out = {k: sum(r[k] for r in rows) for k in _SUMMED}
    for k in (a.QUEUE_DELAY_S, a.TTFT_P90_S, a.ITL_P90_S, a.REVISION_ID):
        out[k] = max(r[k] for r in rows)
    for k in (a.PREFIX_HIT_RATE, a.THROUGHPUT_LOAD):
        out[k] = sum(r[k] for r in rows) / len(rows)
    return out
