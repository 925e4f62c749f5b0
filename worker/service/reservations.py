"""A replica's admission count, kept on the event loop: a request takes its place the moment
it arrives and gives it back when it leaves, so a burst is refused in milliseconds.

The engine's own counts (running, waiting) are updated on the engine thread between steps:
up to a step stale, they let a burst of arrivals all pass a "queue full?" check and then sit
in the engine's inbox until a step ends. :class:`Reservations` answers at once, before a
request reaches the inbox. ``limit`` is in sequences (a request of ``n`` samples takes ``n``)
and is what the replica advertises in its registration (``ReplicaInfo.max_requests``) so
routers can refuse without asking. ``tenant_share`` below 1 also caps each tenant at that
fraction of ``limit``: a tenant that floods is refused first, and the rest of the replica stays
open to the others (a share of the slots reserved for them, whoever arrives first).
"""

from __future__ import annotations

from kvfleet.errors import AlreadyExists, ResourceExhausted


class Reservations:
    """Live requests of one replica by id, and the sequences they hold.

    Args:
        limit: sequences the replica holds at most (running + waiting), > 0.
        tenant_share: fraction of ``limit`` one tenant may hold, in (0, 1].
    """

    def __init__(self, limit: int, tenant_share: float = 1.0) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be > 0, got {limit}")
        self.limit = limit
        self.tenant_limit = max(1, int(limit * tenant_share))
        self.count = 0  # sequences held by live requests
        self._live: dict[str, tuple[str, int]] = {}  # request_id -> (tenant, sequences held)
        self._by_tenant: dict[str, int] = {}

    def take(self, request_id: str, num_seqs: int = 1, tenant: str = "default") -> None:
        """Admit ``request_id`` of ``tenant`` with ``num_seqs`` sequences.

        Raises:
            AlreadyExists: a request with this id is live here.
            ResourceExhausted: the replica holds ``limit`` sequences already, or ``tenant``
                its share of them (the message names the limit).
        """
        if request_id in self._live:
            raise AlreadyExists(f"request_id {request_id!r} is already live on this replica")
        if self.count + num_seqs > self.limit:
            raise ResourceExhausted(
                f"replica is at its limit of {self.limit} running + waiting sequences "
                f"({self.count} held)")
        held = self._by_tenant.get(tenant, 0)
        if held + num_seqs > self.tenant_limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} holds its share of this replica: {held} of "
                f"{self.tenant_limit} running + waiting sequences")
        self._live[request_id] = (tenant, num_seqs)
        self._by_tenant[tenant] = held + num_seqs
        self.count += num_seqs

    def release(self, request_id: str) -> None:
        """``request_id`` left (finished, failed or cancelled); no-op if it holds nothing."""
        tenant, num_seqs = self._live.pop(request_id, ("", 0))
        if num_seqs:
            self.count -= num_seqs
            left = self._by_tenant[tenant] - num_seqs
            if left:
                self._by_tenant[tenant] = left
            else:
                del self._by_tenant[tenant]

    def held_by(self, tenant: str) -> int:
        """Sequences ``tenant``'s live requests hold here."""
        return self._by_tenant.get(tenant, 0)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live
