"""LoRA adapters as the router sees them: which revision a request's adapter hashes with,
which replicas may serve it, and the preference for replicas where it is resident.

Replicas report their servable adapters (name → content revision) and the ones in their
slots now with their registration (:class:`~kvfleet.index_keys.ReplicaInfo`). The router
hashes a request's chain with the revision the replicas serve, so the blocks it looks up are
the blocks the worker will store; a replica mid-reload (another revision) is left out.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from kvfleet.errors import NotFound
from kvfleet.index_keys import ReplicaInfo
from kvfleet.router.policy import Candidate

# A resident replica is preferred unless its load exceeds the least-loaded one's by more than
# this many requests: a load costs a disk read and evicts another adapter.
RESIDENT_LOAD_SLACK = 2


def adapter_revision(live: Sequence[ReplicaInfo], name: str, model: str = "") -> str:
    """The revision most live replicas of ``model`` serve ``name`` at (ties: the greatest).

    Raises:
        NotFound: no live replica serves the adapter (the message names it).
    """
    revisions = Counter(r for r in (info.adapter_revision(name) for info in live) if r is not None)
    if not revisions:
        raise NotFound(f"adapter {name!r} is not served for model {model!r}", field="adapter")
    return max(revisions, key=lambda r: (revisions[r], r))


def serving(candidates: Sequence[Candidate], adapter: tuple[str, str]) -> list[Candidate]:
    """The candidates that serve adapter ``(name, revision)``."""
    name, revision = adapter
    return [c for c in candidates if c.info.adapter_revision(name) == revision]


def prefer_resident(candidates: Sequence[Candidate], name: str,
                    slack: int = RESIDENT_LOAD_SLACK) -> list[Candidate]:
    """Narrow ``candidates`` to those holding adapter ``name`` in a slot (or already holding
    some of the request's blocks) when one of them is within ``slack`` requests of the least
    loaded candidate; otherwise all of them (load balancing wins)."""
    keep = [c for c in candidates if name in c.info.resident_adapters or c.matched_blocks > 0]
    if keep and min(c.load for c in keep) <= min(c.load for c in candidates) + slack:
        return keep
    return list(candidates)


def served_adapters(live: Sequence[ReplicaInfo]) -> list[dict]:
    """Per adapter name the revision :func:`adapter_revision` picks, with how many live
    replicas serve it at that revision and hold it resident (``AdapterInfo``'s fields)."""
    names = sorted({n for info in live for n, _ in info.adapters})
    out = []
    for name in names:
        revision = adapter_revision(live, name)
        at = [info for info in live if info.adapter_revision(name) == revision]
        out.append({"name": name, "revision": revision, "replicas": len(at),
                    "resident_replicas": sum(name in info.resident_adapters for info in at)})
    return out
