"""Running seats among tenants: who may take one, and which waiting sequence is admitted next.

Among tenants the waiting queue is fair by service, not by count: the next sequence admitted
is the oldest waiting one of the tenant that has been served least — weighted prefill tokens
computed (prefix-cache hits are free) plus decode tokens (:mod:`.tenant_service`, a VTC-style
counter charged after every step) — so a tenant that floods the queue, or sends long prompts,
does not hold another tenant's requests behind its own. With ``tenant_share`` below 1 a tenant
also runs at most that share of ``max_num_seqs`` sequences (one with nothing running may always
start one request); a tenant at its share is passed over for the next — unless
(``seats_by_service``, the default) a waiting tenant has been served more than it: then it
may run past its share, so that seats, and with them each tenant's share of the work, follow
service rather than a fixed count, while a tenant ahead that waits for nothing keeps the rest
of its share free for its next arrival (docs/slo.md, "Seats by service"). Tenants compete
within a class; a class whose every waiting tenant holds its share passes the seats to the
classes below it rather than leave them empty.

Seats are counted per request group: a leader's siblings waiting to fork (``n > 1``) hold
theirs beside it.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Optional, Sequence

from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.priority_queue import classes
from kvfleet.worker.engine.scheduling.tenant_service import TenantService

Forks = Mapping[str, Sequence[SequenceState]]  # leader seq_id -> siblings waiting to fork


def group_size(seq: SequenceState, forks: Forks) -> int:
    """Seats ``seq`` takes: itself and its siblings waiting to fork in ``forks``."""
    return 1 + len(forks.get(seq.seq_id, ()))


def seats_taken(running: Sequence[SequenceState], forks: Forks) -> int:
    """Running seats taken: ``running`` and the unforked siblings of its leaders."""
    return len(running) + sum(len(forks.get(s.seq_id, ())) for s in running)


class TenantSeats:
    """The seat rule of one replica (the module's docstring).

    Args:
        max_num_seqs: running seats of the replica.
        tenant_share: fraction of them one tenant holds within its share (0 < share <= 1).
        seats_by_service: whether a tenant may run past its share while a waiting tenant
            has been served more.
        service: the replica's service counters (read, never charged here).
    """

    def __init__(self, max_num_seqs: int, tenant_share: float, seats_by_service: bool,
                 service: TenantService) -> None:
        # Running slots one tenant may hold (tenant_share < 1 keeps the rest for the others,
        # so a newly arrived tenant starts at the next step, not when a flood's requests end).
        self.per_tenant = max(1, int(max_num_seqs * tenant_share))
        # a share of 1 caps nothing the seat rule does not (past max_num_seqs, only a better
        # class's headroom: priority_queue.py), so a tenant sending two classes gets it too
        self.capped = tenant_share < 1
        self.by_service = seats_by_service
        self.service = service

    def may_take(self, tenant: str, held: int, group: int, waiting: Iterable[str]) -> bool:
        """May ``tenant``, holding ``held`` running seats, take ``group`` more? Within its
        share (one with none may always start), or past it (``seats_by_service``) while one
        of the tenants with sequences ``waiting`` has been served more."""
        return (not self.capped or not held or held + group <= self.per_tenant
                or (self.by_service
                    and self.service.behind(tenant, (t for t in waiting if t != tenant))))

    def next_waiting(self, waiting: Iterable[SequenceState], forks: Forks,
                     running_by_tenant: Counter, planned: Mapping[str, float],
                     check_share: bool = True) -> Optional[SequenceState]:
        """Of the best class in ``waiting`` (sorted by class, then FCFS) with a tenant that may
        take a seat (holding ``running_by_tenant[tenant]``; any, ``check_share`` False: the
        caller counts seats its own way), the oldest sequence of its least-served tenant
        (service + ``planned`` this step); None when no tenant of any class may. A class whose
        every tenant holds its share passes the seats to the classes below it, which would
        otherwise wait beside empty seats."""
        for members in classes(waiting):
            picked = self._pick(members, forks, running_by_tenant, planned, check_share)
            if picked is not None:
                return picked
        return None

    def _pick(self, members: Sequence[SequenceState], forks: Forks, running_by_tenant: Counter,
              planned: Mapping[str, float], check_share: bool) -> Optional[SequenceState]:
        """:meth:`next_waiting` within one class's waiting ``members`` (FCFS)."""
        tenants = {s.tenant for s in members}
        oldest: dict[str, SequenceState] = {}
        for s in members:  # arrival order: each tenant's first is its oldest
            if s.tenant not in oldest:
                if not check_share or self.may_take(s.tenant, running_by_tenant[s.tenant],
                                                    group_size(s, forks), tenants):
                    oldest[s.tenant] = s
        # Ties (a tenant just back from idle starts at the others' minimum) go to the tenant
        # running fewer sequences, then to the oldest waiting (sorted is stable).
        tenant = self.service.pick(sorted(oldest, key=running_by_tenant.__getitem__), planned)
        return None if tenant is None else oldest[tenant]
