"""The node's host tier as one Ray actor, and the handle replicas and ranks call it through.

One actor per Ray node and kvfleet deployment (its Redis namespace: two deployments on a node
never share KV), named after both (:func:`tier_actor_name`), owns the tier bytes in its own
heap (a :class:`~.store.HostTierStore`): blocks outlive the replica that wrote them, and every
replica of the deployment on the node shares them. Runs cross in Ray's object store, one object
per run of blocks (a same-node read is a zero-copy view): docs/kv_tier.md has the measurements.
Every call is bounded by a timeout; a dead or slow actor raises, and callers fall back to
recomputing (never an error for a request).

Lifecycle: the latest replica to start on a node sets the actor's capacity and index
(:meth:`NodeTierActor.configure`); a handle whose actor died finds (or starts) the node's next
one on its next call; the deployment's stop removes them (:func:`remove_node_tiers`). The
Redis password never travels in the actor's creation arguments (Ray stores and shows them):
the index names a password-less URL and the actor merges ``KVFLEET_REDIS_PASSWORD`` from its
own environment (:mod:`kvfleet.secrets`), inherited from the replica that started it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvfleet.index_keys import DEFAULT_NAMESPACE, tier_id
from kvfleet.secrets import redis_url_from_env, split_redis_password
from kvfleet.worker.kv_tier.store import HostTierStore, ShardKey, TierStats
from kvfleet.worker.kv_tier.tier_publisher import TierPublisher

log = logging.getLogger(__name__)

NAMESPACE = "kvfleet"  # the Ray namespace of every tier actor
CALL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 60.0  # a tier actor found or started and answering


@dataclass(frozen=True)
class TierIndex:
    """Where a node tier publishes its residency: the prefix index's Redis and namespace.
    Build with :meth:`of`: ``redis_url`` holds no password (these are the actor's creation
    arguments)."""

    redis_url: str
    namespace: str = DEFAULT_NAMESPACE

    @classmethod
    def of(cls, redis_url: str, namespace: str = DEFAULT_NAMESPACE) -> "TierIndex":
        """``redis_url`` without its password (the actor reads it from its environment)."""
        return cls(split_redis_password(redis_url)[0], namespace)


class NodeTierActor:
    """The actor's body (wrapped with ``ray.remote`` by :func:`node_tier`): a
    :class:`HostTierStore` of ``capacity_bytes``, whose residency goes to ``index`` under
    ``tier_id`` when given (:mod:`.tier_publisher`), with the Redis password of this process's
    ``KVFLEET_REDIS_PASSWORD``."""

    def __init__(self, capacity_bytes: int, tier_id: str = "",
                 index: Optional[TierIndex] = None) -> None:
        self.store = HostTierStore(capacity_bytes)
        self.tier_id = tier_id
        self.index: Optional[TierIndex] = None
        self.publisher: Optional[TierPublisher] = None
        self._publish_to(index)

    def _publish_to(self, index: Optional[TierIndex]) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.store.listener, self.publisher = None, None
        self.index = index
        if index is not None and self.tier_id:
            url = redis_url_from_env(index.redis_url, os.environ)
            assert url is not None
            self.publisher = TierPublisher(url, self.tier_id, self.store.held_hashes,
                                           index.namespace)
            self.store.listener = self.publisher.record
            self.publisher.start()

    def configure(self, capacity_bytes: int, index: Optional[TierIndex]) -> TierStats:
        """Take a newly started replica's settings (the latest wins: an operator who changed
        them means them): resize (evicting to fit), publish to ``index``. Returns the stats."""
        if capacity_bytes != self.store.capacity_bytes:
            log.warning("kv tier %s: capacity %d -> %d bytes (a replica started with another "
                        "--kv-host-memory)", self.tier_id, self.store.capacity_bytes,
                        capacity_bytes)
            self.store.resize(capacity_bytes)
        if index != self.index:
            self._publish_to(index)
        return self.store.stats()

    def put(self, rank: ShardKey, hashes: list[bytes], run: np.ndarray, tag: bytes = b"") -> int:
        return self.store.put(rank, hashes, run, tag)

    def lookup(self, hashes: list[bytes], ranks: list[ShardKey]) -> int:
        return self.store.lookup(hashes, ranks)

    def held(self, hashes: list[bytes], ranks: list[ShardKey]) -> list[bool]:
        return self.store.held(hashes, ranks)

    def get(self, rank: ShardKey, hashes: list[bytes]) -> Optional[np.ndarray]:
        return self.store.get(rank, hashes)

    def hottest(self, tag: bytes, ranks: list[ShardKey], max_blocks: int) -> list[bytes]:
        return self.store.hottest(tag, ranks, max_blocks)

    def stats(self) -> TierStats:
        return self.store.stats()

    def clear(self) -> None:
        self.store.clear()


class RayTier:
    """A :class:`HostTierStore`-shaped handle on the tier actor of ``node_id`` for the
    deployment of ``namespace`` (picklable: ranks in other processes receive it in their
    spec). Each call waits at most ``timeout_s``. A call that finds the actor dead drops the
    handle and raises; the next call finds the node's actor again, starting one (empty, with
    ``capacity_bytes`` and ``index``) when none is left, so restores resume after a crash.

    Raises (every method):
        ray.exceptions.RayError, TimeoutError: the actor died, or did not answer in time.
    """

    def __init__(self, actor, capacity_bytes: int, timeout_s: float = CALL_TIMEOUT_S,
                 tier_id: str = "", node_id: str = "", namespace: str = DEFAULT_NAMESPACE,
                 index: Optional[TierIndex] = None) -> None:
        self.actor, self.capacity_bytes, self.timeout_s = actor, capacity_bytes, timeout_s
        self.tier_id = tier_id  # the index's name for it (index_keys.tier_id)
        self.node_id, self.namespace, self.index = node_id, namespace, index

    def _call(self, method: str, *args):
        import ray

        if self.actor is None:
            self.actor = _start_actor(self.node_id, self.namespace, self.capacity_bytes,
                                      self.index)
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            if self.node_id:  # found again (or restarted) on the next call
                self.actor = None
            raise

    def put(self, rank: ShardKey, hashes: Sequence[bytes], run: np.ndarray,
            tag: bytes = b"") -> int:
        return self._call("put", rank, list(hashes), run, tag)

    def lookup(self, hashes: Sequence[bytes], ranks: Sequence[ShardKey]) -> int:
        return self._call("lookup", list(hashes), list(ranks))

    def held(self, hashes: Sequence[bytes], ranks: Sequence[ShardKey]) -> list[bool]:
        return self._call("held", list(hashes), list(ranks))

    def get(self, rank: ShardKey, hashes: Sequence[bytes]) -> Optional[np.ndarray]:
        return self._call("get", rank, list(hashes))

    def hottest(self, tag: bytes, ranks: Sequence[ShardKey], max_blocks: int) -> list[bytes]:
        return self._call("hottest", tag, list(ranks), max_blocks)

    def stats(self) -> TierStats:
        return self._call("stats")

    def clear(self) -> None:
        self._call("clear")

    def on_node(self, node_id: str) -> "RayTier":
        """The same deployment's tier on node ``node_id`` (found, never started: it holds
        blocks or it is of no use). Raises ValueError (Ray's) when that node has none."""
        import ray

        actor = ray.get_actor(tier_actor_name(node_id, self.namespace), namespace=NAMESPACE)
        return RayTier(actor, self.capacity_bytes, self.timeout_s, tier_id(node_id))


def tier_actor_name(node_id: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The tier actor of ``node_id`` for the deployment of Redis namespace ``namespace``."""
    return f"{ACTOR_PREFIX}{node_id}@{namespace}"


ACTOR_PREFIX = "kvfleet-kv-tier-"


def _start_actor(node_id: str, namespace: str, capacity_bytes: int,
                 index: Optional[TierIndex]):
    """The tier actor of ``node_id`` and ``namespace``, started if there is none (detached:
    it outlives the replicas that use it), configured with these settings."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(NodeTierActor).options(
        name=tier_actor_name(node_id, namespace), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(capacity_bytes, tier_id(node_id), index)
    ray.get(actor.configure.remote(capacity_bytes, index),  # type: ignore[attr-defined]
            timeout=START_TIMEOUT_S)
    return actor


def node_tier(capacity_bytes: int, node_id: Optional[str] = None,
              timeout_s: float = CALL_TIMEOUT_S, index: Optional[TierIndex] = None,
              namespace: Optional[str] = None) -> RayTier:
    """The tier actor of ``node_id`` (default: this process's node) for the deployment of
    ``namespace`` (default: ``index``'s, else kvfleet's default), started with
    ``capacity_bytes`` if there is none yet, and set to ``capacity_bytes`` and ``index``
    (password-less: :meth:`TierIndex.of`) if there is.

    Raises:
        ValueError: ``capacity_bytes`` not positive, or an index URL holding a password.
    """
    import ray

    if capacity_bytes <= 0:
        raise ValueError(f"kv host memory must be positive, got {capacity_bytes}")
    if index is not None and split_redis_password(index.redis_url)[1] is not None:
        raise ValueError("the tier's index URL must not hold the Redis password (the actor "
                         "reads KVFLEET_REDIS_PASSWORD): build it with TierIndex.of")
    ns = namespace or (index.namespace if index is not None else DEFAULT_NAMESPACE)
    node_id = node_id or ray.get_runtime_context().get_node_id()
    actor = _start_actor(node_id, ns, capacity_bytes, index)
    return RayTier(actor, capacity_bytes, timeout_s, tier_id(node_id), node_id, ns, index)


def _tier_actors(namespace: Optional[str] = None) -> list[tuple[str, str, str]]:
    """(actor name, node id, deployment namespace) of every tier actor (of ``namespace``)."""
    import ray

    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or not name.startswith(ACTOR_PREFIX):
            continue
        node, _, ns = name[len(ACTOR_PREFIX):].partition("@")
        if namespace is None or ns == namespace:
            out.append((name, node, ns))
    return out


def remove_node_tiers(namespace: str) -> int:
    """Kill the tier actors of the deployment of ``namespace`` on every node (its blocks go
    with them); returns how many. What stopping a deployment does."""
    import ray

    removed = 0
    for name, _, _ in _tier_actors(namespace):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            removed += 1
        except ValueError:  # gone meanwhile
            continue
    return removed


def node_tiers(timeout_s: float = 2.0) -> list[dict]:
    """Every node tier of the connected Ray cluster: node id, deployment namespace and
    :class:`TierStats` fields (what ``kvfleet status`` shows); a tier that does not answer in
    time is listed with ``"error"``."""
    import dataclasses

    import ray

    out = []
    for name, node, ns in _tier_actors():
        row: dict = {"node": node, "namespace": ns}
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            stats: TierStats = ray.get(actor.stats.remote(),  # type: ignore[assignment]
                                       timeout=timeout_s)
            row.update(dataclasses.asdict(stats))
        except Exception as exc:  # a dead or busy tier: shown, not raised
            row["error"] = str(exc).splitlines()[0]
        out.append(row)
    return sorted(out, key=lambda r: (r["namespace"], r["node"]))
