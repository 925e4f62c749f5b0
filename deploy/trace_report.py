"""Where each request's time went, as a table: ``kvfleet demo --trace``.

Columns come from what the client already receives (``kvfleet.client.RequestStats``), each
measured on one process's monotonic clock: prefill and decode as the engine saw them; queue =
the worker's handling time minus prefill and decode (waiting for the engine thread and in the
scheduler's queue, like the ``worker.queue`` span); network = router dispatch − worker time;
other = the client-observed total minus all that (router work + client ↔ router network).
With a trace backend up, each row links its trace.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from typing import Optional, Sequence

from kvfleet.client import RequestStats

DEFAULT_JAEGER_URL = "http://127.0.0.1:16686"


def jaeger_reachable(url: str, timeout_s: float = 1.0) -> bool:
    """True when something answers HTTP at ``url`` (the Jaeger UI)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def breakdown_table(rows: Sequence[tuple[str, RequestStats]],
                    jaeger_url: Optional[str] = None) -> str:
    """One line per request: label, replica, tokens, then milliseconds per phase (+ link)."""
    head = (f"{'request':<44} {'replica':<16} {'cached':>9} {'client TTFT':>11} {'queue':>7} "
            f"{'prefill':>8} {'decode':>8} {'network':>8} {'other':>7} {'total':>8}  (ms)")
    out = [head, "-" * len(head)]
    for label, s in rows:
        t = s.timing or {}
        queue = t.get("queue_s")
        if s.worker_s is not None and t:
            queue = s.worker_s - t["prefill_s"] - t["decode_s"]
        other = None
        if s.total_s is not None and s.worker_s is not None and s.network_s is not None:
            other = s.total_s - s.worker_s - s.network_s
        line = (f"{label[:44]:<44} {s.replica_id[:16]:<16} "
                f"{f'{s.cached_prompt_tokens}/{s.prompt_tokens}':>9} {_ms(s.ttft_s):>11} "
                f"{_ms(queue):>7} {_ms(t.get('prefill_s')):>8} "
                f"{_ms(t.get('decode_s')):>8} {_ms(s.network_s):>8} {_ms(other):>7} "
                f"{_ms(s.total_s):>8}")
        if s.trace_id:
            line += f"  {jaeger_url.rstrip('/')}/trace/{s.trace_id}" if jaeger_url \
                else f"  trace {s.trace_id}"
        out.append(line)
    return "\n".join(out)
