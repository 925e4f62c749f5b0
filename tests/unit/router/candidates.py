"""One factory for the routing tests' :class:`~kvfleet.router.policy.Candidate`: a live replica
(model ``m``, epoch 1, blocks of 16) with a load report, as one routing decision sees it."""

from __future__ import annotations

from typing import Optional

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import Candidate


def candidate(rid: str = "a", *, matched: int = 0, inflight: int = 0, running: int = 0,
              waiting: int = 0, free: int = 10, limit: int = 0, updated_at: float = 0.0,
              delay: Optional[float] = None, per_token: Optional[float] = None, settled: int = 0,
              age: float = 0.0, host: int = 0, address: Optional[str] = None,
              info: Optional[ReplicaInfo] = None, **info_fields) -> Candidate:
    """Replica ``rid`` (or ``info``) matching ``matched`` blocks (``host`` more in its node's
    tier) with ``inflight`` of this router's streams, reporting ``running`` + ``waiting``
    requests, ``free`` of 10 blocks, the forecast ``delay`` / ``per_token`` (seconds; None:
    not advertised), taken ``age`` seconds ago; ``limit``: its advertised ``max_requests``;
    ``info_fields``: other :class:`ReplicaInfo` fields."""
    info = info or ReplicaInfo(rid, address or f"127.0.0.1:{len(rid)}", "m", 1, 16, limit,
                               **info_fields)
    load = ReplicaLoad(running, waiting, free, 10, updated_at, delay, per_token)
    return Candidate(info, load, matched, inflight, settled, report_age_s=age, host_blocks=host)
