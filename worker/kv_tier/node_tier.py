"""The node's host tier as one Ray actor, and the handle replicas and ranks call it through.

One actor per Ray node, named after the node (:func:`node_tier`), owns the node's tier bytes
in its own heap (a :class:`~.store.HostTierStore`): blocks outlive the replica that wrote them,
and every replica of the node shares them. Runs cross in Ray's object store, one object per
run of blocks (a same-node read is a zero-copy view): docs/kv_tier.md has the measurements.
Every call is bounded by a timeout; a dead or slow actor raises, and callers fall back to
recomputing (never an error for a request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvfleet.index_keys import DEFAULT_NAMESPACE, tier_id
from kvfleet.worker.kv_tier.store import HostTierStore, TierStats
from kvfleet.worker.kv_tier.tier_publisher import TierPublisher

NAMESPACE = "kvfleet"
CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TierIndex:
    """Where a node tier publishes its residency: the prefix index's Redis and namespace."""

    redis_url: str
    namespace: str = DEFAULT_NAMESPACE


class NodeTierActor:
    """The actor's body (wrapped with ``ray.remote`` by :func:`node_tier`): a
    :class:`HostTierStore` of ``capacity_bytes``, whose residency goes to ``index`` under
    ``tier_id`` when given (:mod:`.tier_publisher`)."""

    def __init__(self, capacity_bytes: int, tier_id: str = "",
                 index: Optional[TierIndex] = None) -> None:
        self.store = HostTierStore(capacity_bytes)
        self.publisher: Optional[TierPublisher] = None
        if index is not None and tier_id:
            self.publisher = TierPublisher(index.redis_url, tier_id, self.store.held_hashes,
                                           index.namespace)
            self.store.listener = self.publisher.record
            self.publisher.start()

    def put(self, rank: int, hashes: list[bytes], run: np.ndarray, tag: bytes = b"") -> int:
        return self.store.put(rank, hashes, run, tag)

    def lookup(self, hashes: list[bytes], ranks: list[int]) -> int:
        return self.store.lookup(hashes, ranks)

    def get(self, rank: int, hashes: list[bytes]) -> Optional[np.ndarray]:
        return self.store.get(rank, hashes)

    def hottest(self, tag: bytes, ranks: list[int], max_blocks: int) -> list[bytes]:
        return self.store.hottest(tag, ranks, max_blocks)

    def stats(self) -> TierStats:
        return self.store.stats()

    def clear(self) -> None:
        self.store.clear()


class RayTier:
    """A :class:`HostTierStore`-shaped handle on a node's tier actor (picklable: ranks in
    other processes receive it in their spec). Each call waits at most ``timeout_s``.

    Raises (every method):
        ray.exceptions.RayError, TimeoutError: the actor died, or did not answer in time.
    """

    def __init__(self, actor, capacity_bytes: int, timeout_s: float = CALL_TIMEOUT_S,
                 tier_id: str = "") -> None:
        self.actor, self.capacity_bytes, self.timeout_s = actor, capacity_bytes, timeout_s
        self.tier_id = tier_id  # the index's name for it (index_keys.tier_id)

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def put(self, rank: int, hashes: Sequence[bytes], run: np.ndarray, tag: bytes = b"") -> int:
        return self._get(self.actor.put.remote(rank, list(hashes), run, tag))

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[int]) -> int:
        return self._get(self.actor.lookup.remote(list(hashes), list(ranks)))

    def get(self, rank: int, hashes: Sequence[bytes]) -> Optional[np.ndarray]:
        return self._get(self.actor.get.remote(rank, list(hashes)))

    def hottest(self, tag: bytes, ranks: Sequence[int], max_blocks: int) -> list[bytes]:
        return self._get(self.actor.hottest.remote(tag, list(ranks), max_blocks))

    def stats(self) -> TierStats:
        return self._get(self.actor.stats.remote())

    def clear(self) -> None:
        self._get(self.actor.clear.remote())


def tier_actor_name(node_id: str) -> str:
    return f"kvfleet-kv-tier-{node_id}"


def node_tier(capacity_bytes: int, node_id: Optional[str] = None,
              timeout_s: float = CALL_TIMEOUT_S, index: Optional[TierIndex] = None) -> RayTier:
    """The tier actor of ``node_id`` (default: this process's node), started with
    ``capacity_bytes`` if the node has none yet (an existing one keeps its capacity and its
    ``index``: the first replica on a node sizes it and names where its residency is
    published). Detached: it outlives the replicas that use it.

    Raises:
        ValueError: ``capacity_bytes`` not positive.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if capacity_bytes <= 0:
        raise ValueError(f"kv host memory must be positive, got {capacity_bytes}")
    node_id = node_id or ray.get_runtime_context().get_node_id()
    actor = ray.remote(NodeTierActor).options(
        name=tier_actor_name(node_id), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(capacity_bytes, tier_id(node_id), index)
    stats: TierStats = ray.get(actor.stats.remote(),  # type: ignore[attr-defined,assignment]
                               timeout=60.0)  # started (or found)
    return RayTier(actor, stats.capacity_bytes, timeout_s, tier_id(node_id))


def node_tiers(timeout_s: float = 2.0) -> list[dict]:
    """Every node tier of the connected Ray cluster: node id and :class:`TierStats` fields
    (what ``kvfleet status`` shows); a tier that does not answer in time is listed with
    ``"error"``."""
    import dataclasses

    import ray

    prefix = tier_actor_name("")
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE or not entry["name"].startswith(prefix):
            continue
        row: dict = {"node": entry["name"][len(prefix):]}
        try:
            actor = ray.get_actor(entry["name"], namespace=NAMESPACE)
            stats: TierStats = ray.get(actor.stats.remote(),  # type: ignore[assignment]
                                       timeout=timeout_s)
            row.update(dataclasses.asdict(stats))
        except Exception as exc:  # a dead or busy tier: shown, not raised
            row["error"] = str(exc).splitlines()[0]
        out.append(row)
    return sorted(out, key=lambda r: r["node"])
