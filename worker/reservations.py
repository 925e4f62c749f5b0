"""A replica's admission count, kept on the event loop: a request takes its place the moment
it arrives and gives it back when it leaves, so a burst is refused in milliseconds.

The engine's own counts (running, waiting) are updated on the engine thread between steps:
up to a step stale, they let a burst of arrivals all pass a "queue full?" check and then sit
in the engine's inbox until a step ends. :class:`Reservations` answers at once, before a
request reaches the inbox. ``limit`` is in sequences (a request of ``n`` samples takes ``n``)
and is what the replica advertises in its registration (``ReplicaInfo.max_requests``) so
routers can refuse without asking.
"""

from __future__ import annotations

from kvfleet.errors import AlreadyExists, ResourceExhausted


class Reservations:
    """Live requests of one replica by id, and the sequences they hold.

    Args:
        limit: sequences the replica holds at most (running + waiting), > 0.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be > 0, got {limit}")
        self.limit = limit
        self.count = 0  # sequences held by live requests
        self._live: dict[str, int] = {}  # request_id -> sequences it holds

    def take(self, request_id: str, num_seqs: int = 1) -> None:
        """Admit ``request_id`` with ``num_seqs`` sequences.

        Raises:
            AlreadyExists: a request with this id is live here.
            ResourceExhausted: the replica holds ``limit`` sequences already (the message
                names the limit).
        """
        if request_id in self._live:
            raise AlreadyExists(f"request_id {request_id!r} is already live on this replica")
        if self.count + num_seqs > self.limit:
            raise ResourceExhausted(
                f"replica is at its limit of {self.limit} running + waiting sequences "
                f"({self.count} held)")
        self._live[request_id] = num_seqs
        self.count += num_seqs

    def release(self, request_id: str) -> None:
        """``request_id`` left (finished, failed or cancelled); no-op if it holds nothing."""
        self.count -= self._live.pop(request_id, 0)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live
