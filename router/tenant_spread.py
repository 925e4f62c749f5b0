"""Tenant-aware spread: a light tenant's burst is split across replicas, not piled on one.

A replica that divides its seats among tenants (``tenant_share`` < 1) admits a tenant within
its share at once, and makes one past it compete by service. Placement by load or working-set
room does not see tenants: beside a flood that loads every replica alike, a light tenant's new
requests can land mostly on one replica, past its share there while its share on another sits
unused, and its prompts also queue behind its own prompt in the step in flight.

So the router counts its own open requests per (tenant, replica) (``InflightLedger``), and a
decision for a **light** tenant carries them (``Candidate.tenant_inflight``). A tenant is light
when other tenants have requests open on this router too and, with this request, it holds no
more than its even share of them: ``(T + 1) × K ≤ total + 1`` for ``T`` of the router's
``total`` open requests and ``K`` tenants with requests open (this one included). A tenant
alone, or one holding more than its share (a flood), is past its share on every replica
anyway: spreading it buys no seat, and its placement stays room's and load's.

:func:`tenant_excess` is, per candidate, how far the request would put the tenant past its
**even split** over the candidates, ``ceil((Σ tenant_inflight + 1) / n)``; 0 everywhere when the
decision carries no counts. The policies order new-family placement by it first (before the
backlog-guarded working-set room of ``predicted_ttft``, before ``prefix_aware``'s load score),
and ``prefix_aware`` breaks equal scores with it. A prefix hit is not moved by it: the deepest
holders still win (a copy is the bound's to make), so a light tenant whose requests share one
prefix stays with that prefix's holders.

Each router spreads its own requests (the counts are its own): with N routers behind a load
balancer each tenant's share of each router's traffic is spread, which spreads the sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from kvfleet.router.policy import Candidate


def light_counts(mine: Mapping[str, int], others: int, total: int) -> dict[str, int]:
    """``mine`` (a tenant's open requests per replica id, this router's) when the tenant is
    light beside ``others`` tenants with requests open, ``total`` requests open on this router
    in all (module docstring), else ``{}``."""
    if others == 0 or (sum(mine.values()) + 1) * (others + 1) > total + 1:
        return {}
    return {rid: n for rid, n in mine.items() if n > 0}


def tenant_excess(candidates: Sequence[Candidate]) -> dict[str, int]:
    """Replica id → how many requests past its even split over ``candidates`` the tenant would
    hold there with this request: ``max(0, t + 1 − ceil((Σ t + 1) / n))`` for ``t`` its
    ``tenant_inflight`` on that replica and ``n`` candidates. All 0 when no candidate carries
    a count (a tenant that is not light, an open router)."""
    total = sum(c.tenant_inflight for c in candidates)
    even = -(-(total + 1) // max(1, len(candidates)))  # ceil
    return {c.info.replica_id: max(0, c.tenant_inflight + 1 - even) for c in candidates}
