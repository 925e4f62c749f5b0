"""What kvfleet's autoscaling policy (:func:`kvfleet.worker.replica.autoscale.decide`) needs
of time, kept from one control-loop tick to the next: Serve's wrapper
(``kvfleet.deploy.autoscale_serve``) and the simulator (``bench/sim/autoscale_sim.py``) hold
a :class:`FleetClock` and hand :func:`decide` its :class:`Clocks`. Pure: the caller passes the
time (any monotonic clock, seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Clocks:
    """Seconds: ``pending_s`` — Serve's target has been above the running count (replicas
    asked for, not running); ``settled_s`` — the running count has held, less the window
    Serve averages the signals over; ``missing_s`` — some running replica's report has been
    incomplete. The defaults: nothing pending, settled for ever, nothing missing."""

    pending_s: float = 0.0
    settled_s: float = math.inf
    missing_s: float = 0.0


class FleetClock:
    """:class:`Clocks` from Serve's counts at each tick: the pending time restarts when the
    target moves; the first count seen counts as settled (no earlier count is in the latency
    window); ``look_back_s``: Serve's averaging window, subtracted from the settled time."""

    def __init__(self, look_back_s: float = 0.0) -> None:
        self.look_back_s = look_back_s
        self._pending_since: Optional[float] = None
        self._missing_since: Optional[float] = None
        self._target: Optional[int] = None
        self._count: Optional[int] = None
        self._changed_at = -math.inf

    def observe(self, current: int, target: int, complete: bool, now: float) -> Clocks:
        """The clocks at ``now``; ``complete``: every running replica reported every signal
        (:func:`kvfleet.worker.replica.autoscale.complete`)."""
        if target <= current:
            self._pending_since = None
        elif self._pending_since is None or target != self._target:
            self._pending_since = now
        self._target = target
        if self._count is not None and current != self._count:
            self._changed_at = now
        self._count = current
        if complete:
            self._missing_since = None
        elif self._missing_since is None:
            self._missing_since = now
        return Clocks(_since(self._pending_since, now), now - self._changed_at - self.look_back_s,
                      _since(self._missing_since, now))


def _since(start: Optional[float], now: float) -> float:
    return 0.0 if start is None else now - start
