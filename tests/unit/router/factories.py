"""The routing tests' one way to build what a decision sees: a replica's registry entry
(:func:`info`), its load report (:func:`report`), a candidate (:func:`cand`) and a chain of
block hashes (:func:`chain`). Defaults: model ``m``, 16-token blocks, an idle replica with 10
free blocks of 10, a report taken at ``at`` (unix seconds) without the forecast fields."""

from __future__ import annotations

from typing import Optional, Union

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import Candidate

BLOCK_SIZE = 16


def info(rid: str, adapters=(), resident=(), *, limit: int = 0, kv_tier: str = "",
         address: Optional[str] = None) -> ReplicaInfo:
    """Replica ``rid``'s registry entry: ``adapters`` it may serve and those ``resident``
    ((name, revision) pairs), ``limit`` its advertised ``max_requests``."""
    return ReplicaInfo(rid, address or f"127.0.0.1:{len(rid)}", "m", 1, BLOCK_SIZE, limit,
                       kv_tier=kv_tier, adapters=tuple(adapters), resident_adapters=tuple(resident))


def report(running: int = 0, waiting: int = 0, *, free: int = 10, total: int = 10,
           at: float = 0.0, delay: Optional[float] = None,
           per_token: Optional[float] = None) -> ReplicaLoad:
    """A load report; ``delay`` / ``per_token``: the forecast (``queue_delay_s``,
    ``prefill_token_s``), absent when None."""
    return ReplicaLoad(running, waiting, free, total, at, delay, per_token)


def cand(replica: Union[str, ReplicaInfo], matched: int = 0, *, inflight: int = 0,
         settled: int = 0, host: int = 0, age: float = 0.0, limit: int = 0,
         kv_tier: str = "", reported: bool = True, tenant_inflight: int = 0,
         **load) -> Candidate:
    """A candidate: ``replica`` (an id, or its entry), ``matched`` device blocks, ``host``
    blocks after them in its node tier, this router's ``inflight`` / ``settled`` requests
    (``tenant_inflight``: the request's tenant's, as the tenant spread counts them), a report
    ``age`` seconds old (none at all unless ``reported``); ``load``: :func:`report`'s
    arguments."""
    entry = replica if isinstance(replica, ReplicaInfo) else info(replica, limit=limit,
                                                                  kv_tier=kv_tier)
    return Candidate(entry, report(**load) if reported else None, matched, inflight, settled,
                     report_age_s=age, host_blocks=host, tenant_inflight=tenant_inflight)


def chain(name: bytes, n: int) -> list[bytes]:
    """``n`` distinct block hashes named after ``name``."""
    return [name + b"-%d" % i for i in range(n)]
