"""Routing policies: pick a replica from candidates with their prefix match and load.

* ``prefix_aware`` (default): maximise ``matched_blocks − load_penalty_blocks × load`` so a
  request goes where its prefix already sits unless that replica is busier by more than the
  prefix is worth; ties go to the least loaded, then to rendezvous hashing on the first
  block's hash, so a new prefix family lands on one replica consistently (across routers too).
* ``least_loaded`` and ``round_robin``: baselines for benchmarks.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad


@dataclass(frozen=True)
class Candidate:
    """A live replica as one routing decision sees it."""

    info: ReplicaInfo
    load_report: Optional[ReplicaLoad]
    matched_blocks: int
    inflight: int  # this router's own open streams to the replica

    @property
    def load(self) -> int:
        """Requests on the replica: its report, or this router's count when larger/fresher."""
        reported = (self.load_report.running + self.load_report.waiting) if self.load_report else 0
        return max(reported, self.inflight)


def rendezvous_score(key: bytes, replica_id: str) -> bytes:
    """Highest-random-weight hashing score; the max over replicas picks the owner of ``key``."""
    return hashlib.sha256(key + b"\x00" + replica_id.encode()).digest()


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], first_block: bytes) -> Candidate:
        """Pick one of a non-empty list of candidates."""


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, load_penalty_blocks: float = 1.0) -> None:
        self.load_penalty_blocks = load_penalty_blocks

    def choose(self, candidates: Sequence[Candidate], first_block: bytes) -> Candidate:
        def key(c: Candidate):
            score = c.matched_blocks - self.load_penalty_blocks * c.load
            return (score, -c.load, rendezvous_score(first_block, c.info.replica_id))
        return max(candidates, key=key)


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates: Sequence[Candidate], first_block: bytes) -> Candidate:
        return max(candidates, key=lambda c: (-c.load, rendezvous_score(first_block, c.info.replica_id)))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], first_block: bytes) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.info.replica_id)
        return ordered[next(self._counter) % len(ordered)]


POLICIES = {"prefix_aware": PrefixAware, "least_loaded": LeastLoaded, "round_robin": RoundRobin}


def make_policy(name: str) -> RoutingPolicy:
    """Raises ValueError naming the valid policies."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
