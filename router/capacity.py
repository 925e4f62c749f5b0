"""Refuse at once what no replica can take: before tokenizing, hashing or routing.

Each replica advertises its limit (``ReplicaInfo.max_requests``: running + waiting sequences)
in its registration; a candidate's load is the router's best count of what it holds
(``Candidate.load``: its last report corrected by this router's own streams). When every
candidate is at its limit the request is refused with RESOURCE_EXHAUSTED and gRPC's retry
hint, the ``grpc-retry-pushback-ms`` trailer, instead of waiting for a worker to refuse it.
A replica with no advertised limit always counts as having room (its worker decides).
A tenant's own limit (``Authenticator.tenant_limit``: the key file's, per router) is checked
first, so a tenant that floods is refused before it fills the fleet.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kvfleet.errors import ResourceExhausted
from kvfleet.router.policy import Candidate

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's standard retry hint (A6 retry design)
DEFAULT_RETRY_PUSHBACK_MS = 1000  # about one load report: when the router's view next changes


def has_room(c: Candidate) -> bool:
    """True when ``c`` is below its advertised limit (or advertises none)."""
    limit = c.info.max_requests
    return limit <= 0 or c.load < limit


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


def check_room(candidates: Sequence[Candidate], model: str) -> None:
    """Raises ResourceExhausted (naming the limit) when every candidate is at its limit."""
    if candidates and not any(has_room(c) for c in candidates):
        limits = sorted({c.info.max_requests for c in candidates})
        raise ResourceExhausted(
            f"every replica of model {model!r} is at its limit of "
            f"{'/'.join(map(str, limits))} running + waiting sequences")
