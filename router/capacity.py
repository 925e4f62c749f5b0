"""Refuse at once what no replica can take: before tokenizing, hashing or routing.

Each replica advertises its limits in its registration (``ReplicaInfo.max_requests``: running +
waiting sequences; ``max_queue_wait_s``: the predicted wait it admits, against its load
report's ``queue_delay_s``); a candidate's load is the router's best count of what it holds
(``Candidate.load``: its last report corrected by this router's own streams). When every
candidate is at its limit the request is refused with RESOURCE_EXHAUSTED and gRPC's retry
hint, the ``grpc-retry-pushback-ms`` trailer, instead of waiting for a worker to refuse it.
A replica with no advertised limit always counts as having room (its worker decides).
A tenant's own limit (``Authenticator.tenant_limit``: the key file's, per router) is checked
first, so a tenant that floods is refused before it fills the fleet.

Priority classes keep headroom for the classes above them (:func:`check_class_room`): a
request whose band (``kvfleet.priority.band``) is admitted at fraction ``f`` of the fleet's
advertised capacity is refused once the candidates hold ``f ×`` that capacity (by default
``batch`` at 80 %, ``default`` and ``interactive`` at 100 %). Every refusal names the class.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from kvfleet import priority
from kvfleet.errors import ResourceExhausted
from kvfleet.router.policy import Candidate

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's standard retry hint (A6 retry design)
DEFAULT_RETRY_PUSHBACK_MS = 1000  # about one load report: when the router's view next changes


def has_room(c: Candidate) -> bool:
    """True when ``c`` is below its advertised limits (or advertises none): its running +
    waiting sequences, and its last report's predicted queue delay against its queue bound
    (``max_queue_wait_s``: the replica would refuse a newcomer)."""
    return not (_at_count(c) or _past_bound(c))


def _at_count(c: Candidate) -> bool:
    return 0 < c.info.max_requests <= c.load


def _past_bound(c: Candidate) -> bool:
    bound, report = c.info.max_queue_wait_s, c.load_report
    return bound > 0 and report is not None and (report.queue_delay_s or 0.0) >= bound


def with_room(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates below their limits; all of them when none is (the worker then decides)."""
    roomy = [c for c in candidates if has_room(c)]
    return roomy or list(candidates)


def fleet_capacity(candidates: Sequence[Candidate]) -> int:
    """Sum of the candidates' advertised limits; 0 when any advertises none (unknown)."""
    limits = [c.info.max_requests for c in candidates]
    return 0 if not limits or min(limits) <= 0 else sum(limits)


def check_tenant(tenant: str, inflight: int, limit: Optional[int]) -> None:
    """Raises ResourceExhausted when ``tenant`` holds ``limit`` in-flight requests already."""
    if limit is not None and inflight >= limit:
        raise ResourceExhausted(f"tenant {tenant!r} is at its limit of {limit} in-flight "
                                f"requests on this router")


def check_room(candidates: Sequence[Candidate], model: str,
               level: int = priority.DEFAULT) -> None:
    """Raises ResourceExhausted (naming the limit and the class of priority ``level``)
    when every candidate is at its limit."""
    if candidates and not any(has_room(c) for c in candidates):
        counts = sorted({c.info.max_requests for c in candidates if _at_count(c)})
        bounds = sorted({c.info.max_queue_wait_s for c in candidates if not _at_count(c)})
        limits = []
        if counts:
            limits.append(f"limit of {'/'.join(map(str, counts))} running + waiting sequences")
        if bounds:
            limits.append(f"queue bound of {'/'.join(f'{b:g}' for b in bounds)} s "
                          f"(max_queue_wait_s)")
        raise ResourceExhausted(
            f"every replica of model {model!r} is at its {' or '.join(limits)} (refused: "
            f"{priority.describe(level)} request)")


def check_class_room(candidates: Sequence[Candidate], model: str, level: int,
                     admit: Mapping[str, float]) -> None:
    """Raises ResourceExhausted, naming the class, when the candidates hold at least
    ``admit[band(level)]`` of the fleet's capacity (a fraction of 1, or an unknown capacity,
    never refuses here: :func:`check_room` decides)."""
    fraction = admit[priority.band(level)]
    capacity = fleet_capacity(candidates)
    if fraction >= 1 or capacity <= 0:
        return
    held, limit = sum(c.load for c in candidates), max(1, int(fraction * capacity))
    if held >= limit:
        raise ResourceExhausted(
            f"{priority.describe(level)} requests to model {model!r} are refused while its "
            f"replicas hold {held} of {capacity} running + waiting sequences (this class is "
            f"admitted up to {fraction:.0%}; the rest is kept for higher classes)")
