"""Routing policies: pick a replica from candidates with their prefix match and load.

``prefix_aware`` (what the default, ``predicted_ttft``, falls back to). Per request, with ``m``
= a replica's matched leading blocks and ``load`` = its requests (running + waiting: the larger
of its last report, less this router's requests that report counts but that have finished
since, and this router's own in-flight count, so a burst counts before the next heartbeat and
a finished one stops counting at once):

1. **Score** ``m − load_penalty_blocks × load``; the highest wins. ``m`` includes a replica's
   host-tier hits at ``host_hit_weight`` each (``router/tier_credit.py``). Ties go to the deeper match
   (a report one heartbeat old can still count another router's finished request: a holder
   that looks one request busier than a replica with one block less keeps the conversation),
   then to the least loaded;
   among holders of equally long prefixes, to the one with the lowest *recent* load (an
   exponential average over ~``RECENT_WINDOW`` decisions per replica), so a shared family's
   traffic fills the holder with the least other work; then to rendezvous hashing on the first
   block's hash — a new prefix family (``m = 0`` everywhere) lands on the least-loaded replica,
   and on the same one from every router when their views agree. With no block to hash (a
   prompt shorter than a block), equal candidates take turns (``TieOrder``).
2. **Bounded imbalance.** The router also keeps the exponentially weighted share of recent
   requests whose deepest cached block is a given one (the prefix's *popularity*). A prefix gets
   one more holder — the request goes to the least-loaded replica that lacks it, which computes
   it once and from then on shares the family's traffic — when either
   * its own traffic would give each holder more than ``max_imbalance`` fair shares
     (``popularity × replicas > max_imbalance × holders``: a hot prefix, seen at once), or
   * every holder's *smoothed* load (averaged over ~``load_window`` decisions per replica, after
     a warm-up of ``WARM_UP_SAMPLES``) exceeds ``max_imbalance ×`` the fleet's mean, and that
     mean by at least ``min_excess_load`` requests. The absolute floor keeps an idle fleet's
     prefixes in place: near zero load the ratio is noise (a load report is up to one heartbeat
     old, so the replica that served the last request looks busy), and a copy would cost a full
     prefill to save nothing. SGLang's router pairs its relative balance threshold with an
     absolute one for the same reason.
   A copy sent but not yet visible in the index counts as a holder for a while, so a burst does
   not start one copy per request. A prefix on a replica within the bound is never copied: under
   uniform popularity each family stays on one replica and the fleet's KV holds as many distinct
   prefixes as it can; a holder loses a request to plain load only when it is busier than an
   idle replica by more than the prefix is worth (``m / load_penalty_blocks`` requests).
3. **KV saturation.** A replica whose KV blocks are ``kv_saturation`` or more in use by live
   requests (last report) is skipped while another is not: it could not admit the request.

4. **Tenant spread.** A request of a tenant that is light beside others goes, for a new
   family, where its tenant would be least past its even split of the tenant's open requests
   (ahead of the score), and breaks equal scores the same way (``router/tenant_spread.py``).

``predicted_ttft`` (the default) keeps 2, 3 and 4 and scores in seconds instead
(``router/predicted_ttft.py``); a decision where a replica's report lacks the forecast is
``prefix_aware``'s.
``least_loaded`` and ``round_robin`` are the baselines benchmarks compare against.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.tenant_spread import tenant_excess
from kvfleet.router.tier_credit import DEFAULT_HOST_HIT_WEIGHT, host_credit_blocks

DEFAULT_LOAD_PENALTY_BLOCKS = 1.0
DEFAULT_MAX_IMBALANCE = 1.25
DEFAULT_POPULARITY_WINDOW = 256  # routing decisions
DEFAULT_LOAD_WINDOW = 64  # routing decisions per replica the smoothed load averages over
DEFAULT_KV_SATURATION = 0.98
DEFAULT_MIN_EXCESS_LOAD = 1.0  # requests over the fleet's mean before a holder counts as overloaded
WARM_UP_SAMPLES = 16  # decisions per replica before smoothed loads may trigger a copy
RECENT_WINDOW = 4     # decisions per replica of the fast load average (holder tie-breaks)


@dataclass(frozen=True)
class Candidate:
    """A live replica as one routing decision sees it."""

    info: ReplicaInfo
    load_report: Optional[ReplicaLoad]
    matched_blocks: int
    inflight: int  # this router's own open streams to the replica
    settled: int = 0  # this router's requests the report still counts that have finished
    report_age_s: float = 0.0  # seconds since the report was taken (this router's clock)
    # Blocks after the device match that its node's host tier holds (restored, not computed).
    host_blocks: int = 0
    # The request's tenant's open streams on the replica (this router's), when the tenant is
    # light beside others; else 0 (router/tenant_spread.py).
    tenant_inflight: int = 0

    @property
    def reported(self) -> Optional[int]:
        """Running + waiting requests in the last report; ``None`` without one."""
        r = self.load_report
        return None if r is None else r.running + r.waiting

    @property
    def load(self) -> int:
        """Requests on the replica: its report less those known finished since, or this
        router's own open streams when that is more (see ``router.inflight``)."""
        reported = self.reported
        return max(0 if reported is None else reported - self.settled, self.inflight, 0)

    def describe(self) -> str:
        """``"<id> matched=<blocks> load=<requests> (reported=R settled=S inflight=I)"`` (with
        `` host=H`` / `` tenant=T`` after the match when not 0): the decision's inputs, for the
        ``kvfleet.route.candidates`` span attribute and debug logs."""
        reported = "none" if self.reported is None else self.reported
        extra = f" host={self.host_blocks}" if self.host_blocks else ""
        extra += f" tenant={self.tenant_inflight}" if self.tenant_inflight else ""
        return (f"{self.info.replica_id} matched={self.matched_blocks}{extra} load={self.load} "
                f"(reported={reported} settled={self.settled} inflight={self.inflight})")

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by live requests, from the last report (0 if none)."""
        r = self.load_report
        if r is None or r.num_total_blocks <= 0:
            return 0.0
        return 1.0 - r.num_free_blocks / r.num_total_blocks


def rendezvous_score(key: bytes, replica_id: str) -> bytes:
    """Highest-random-weight hashing score; the max over replicas picks the owner of ``key``."""
    return hashlib.sha256(key + b"\x00" + replica_id.encode()).digest()


class TieOrder:
    """The last tie-break between otherwise equal candidates.

    With a block to hash, rendezvous on it: a prefix family's owner, the same from every
    router. Without one (a prompt shorter than a block, or a router routing blind while the
    prefix index is unreachable) there is no family to keep together, and a fixed hash would
    send every such request to one replica while loads are equal (an idle fleet, sequential
    requests): equal candidates take turns instead, each decision starting one replica (in id
    order) further on.
    """

    def __init__(self) -> None:
        self._turn = 0

    def ranks(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> dict[str, int]:
        """Replica id → rank (0 wins the tie) for one decision over ``candidates``."""
        ids = sorted({c.info.replica_id for c in candidates})
        if chain:
            ids.sort(key=lambda rid: rendezvous_score(chain[0], rid), reverse=True)
        elif ids:
            turn, self._turn = self._turn % len(ids), self._turn + 1
            ids = ids[turn:] + ids[:turn]
        return {rid: i for i, rid in enumerate(ids)}


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        """Pick one of a non-empty list of candidates for a request's block-hash ``chain``."""


class PrefixPopularity:
    """Exponentially weighted share of routing decisions per key, over ~``window`` decisions.

    ``observe(key)`` counts one decision for ``key`` and returns its share in [0, 1]: the
    probability, recently, that a request's deepest cached block was ``key``. Keeps at most
    ``capacity`` keys (least recently seen dropped first).
    """

    def __init__(self, window: int = DEFAULT_POPULARITY_WINDOW, capacity: int = 8192) -> None:
        if window < 1 or capacity < 1:
            raise ValueError("window and capacity must be >= 1")
        self._keep = 1.0 - 1.0 / window
        self._capacity = capacity
        self._decisions = 0
        self._shares: OrderedDict[bytes, tuple[float, int]] = OrderedDict()  # key → (share, at)

    def observe(self, key: bytes) -> float:
        self._decisions += 1
        share, at = self._shares.pop(key, (0.0, self._decisions))
        share = share * self._keep ** (self._decisions - at) + (1.0 - self._keep)
        self._shares[key] = (share, self._decisions)
        if len(self._shares) > self._capacity:
            self._shares.popitem(last=False)
        return share

    def skip(self) -> None:
        """A decision for no key (a request with nothing cached anywhere)."""
        self._decisions += 1


class PrefixAware:
    """See the module docstring. Holds per-router state: prefix popularity, a smoothed load per
    replica, and copies started but not yet visible in the index."""

    name = "prefix_aware"
    uses_index = True  # the router looks the chain up in the prefix index for it

    def __init__(self, load_penalty_blocks: float = DEFAULT_LOAD_PENALTY_BLOCKS,
                 max_imbalance: float = DEFAULT_MAX_IMBALANCE,
                 popularity_window: int = DEFAULT_POPULARITY_WINDOW,
                 load_window: int = DEFAULT_LOAD_WINDOW,
                 kv_saturation: float = DEFAULT_KV_SATURATION,
                 min_excess_load: float = DEFAULT_MIN_EXCESS_LOAD,
                 host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT) -> None:
        if load_penalty_blocks < 0 or max_imbalance < 1 or load_window < 1 \
                or not 0 < kv_saturation <= 1 or min_excess_load < 0 \
                or not 0 <= host_hit_weight <= 1:
            raise ValueError("need load_penalty_blocks >= 0, max_imbalance >= 1, "
                             "load_window >= 1, 0 < kv_saturation <= 1, min_excess_load >= 0, "
                             "0 <= host_hit_weight <= 1")
        self.host_hit_weight = host_hit_weight
        self.load_window = load_window
        self.min_excess_load = min_excess_load
        self.load_penalty_blocks = load_penalty_blocks
        self.max_imbalance = max_imbalance
        self.kv_saturation = kv_saturation
        self.popularity = PrefixPopularity(popularity_window)
        self._window = popularity_window
        self.avg_load: dict[str, float] = {}     # over ~load_window decisions per replica
        self.recent_load: dict[str, float] = {}  # over ~RECENT_WINDOW: tie-breaks among holders
        # prefix key → {replica_id: decision number}: copies started but not yet in the index
        self._copies: dict[bytes, dict[str, int]] = {}
        self._decisions = 0
        self.ties = TieOrder()

    def choose(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        self._decisions += 1
        avg = self._observe_loads(candidates)
        usable = [c for c in candidates if c.kv_usage < self.kv_saturation] or list(candidates)
        best = max(c.matched_blocks for c in usable)
        if best == 0:
            self.popularity.skip()
            return self._best_score(usable, chain)
        key = chain[best - 1]
        holders = {c.info.replica_id for c in usable if c.matched_blocks == best}
        holders |= self._pending_copies(key, holders)
        fair_shares = self.popularity.observe(key) * len(candidates)
        if self._needs_holder(fair_shares, holders, avg, usable, chain):
            others = [c for c in usable if c.info.replica_id not in holders]
            if others:
                target = self._copy_target(others, chain, avg)
                self._copies.setdefault(key, {})[target.info.replica_id] = self._decisions
                return target
        return self._best_score(usable, chain)

    def _copy_target(self, others: Sequence[Candidate], chain: Sequence[bytes],
                     avg: dict[str, float]) -> Candidate:
        """Where a prefix's new holder goes: the least-loaded replica that lacks it."""
        return min(others, key=lambda c: (c.load, avg[c.info.replica_id], rendezvous_desc(chain[0], c)))

    def _needs_holder(self, fair_shares: float, holders: set[str], avg: dict[str, float],
                      candidates: Sequence[Candidate], chain: Sequence[bytes]) -> bool:
        """Another holder is needed when the prefix's own traffic gives each holder more than
        ``max_imbalance`` fair shares (a hot prefix, seen at once), or when every holder's
        smoothed load is above ``max_imbalance ×`` the mean and above the mean by
        ``min_excess_load`` requests (any prefix: the bound). ``candidates`` and ``chain``
        (the decision's) are for subclasses that size the excess per request."""
        if fair_shares > self.max_imbalance * len(holders):
            return True
        return self._overloaded(holders, avg, self.min_excess_load)

    def _overloaded(self, holders: set[str], avg: dict[str, float], min_excess: float,
                    warm_up: bool = True) -> bool:
        """Every holder's smoothed load in ``avg`` is above ``max_imbalance ×`` the mean and
        above the mean by ``min_excess`` (in ``avg``'s unit); False during the warm-up
        unless ``warm_up`` is False."""
        if warm_up and self._decisions < WARM_UP_SAMPLES * len(avg):
            return False  # too few samples: the smoothed loads are still noise
        mean = sum(avg.values()) / len(avg)
        bound = max(self.max_imbalance * mean, mean + min_excess)
        return all(avg.get(h, 0.0) > bound for h in holders)

    def _best_score(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        """Highest score; then the deeper match (the score says the extra load is worth the
        extra cached blocks, and sending the request elsewhere would copy the prefix); then
        the tenant's excess over its even split; then least loaded; holders then by recent
        load (the one with less other work takes the shared family's traffic); then
        :class:`TieOrder` (rendezvous on the first block). A new family (nothing cached
        anywhere) goes by the tenant's excess first (``router/tenant_spread.py``)."""
        cached = {c.info.replica_id: c.matched_blocks + host_credit_blocks(c, self.host_hit_weight)
                  for c in candidates}  # host-tier hits at their weight (router/tier_credit.py)
        rank = self.ties.ranks(candidates, chain)
        excess = tenant_excess(candidates)
        new = not any(cached.values())
        return max(candidates, key=lambda c: (
            -excess[c.info.replica_id] if new else 0,
            cached[c.info.replica_id] - self.load_penalty_blocks * c.load,
            cached[c.info.replica_id], -excess[c.info.replica_id], -c.load,
            -self.recent_load.get(c.info.replica_id, 0.0) if c.matched_blocks else 0.0,
            -rank[c.info.replica_id]))

    def _observe_loads(self, candidates: Sequence[Candidate]) -> dict[str, float]:
        """Update each replica's exponentially weighted load (one sample per decision)."""
        k = 1.0 - 1.0 / (self.load_window * len(candidates))
        fast = 1.0 - 1.0 / (RECENT_WINDOW * len(candidates))
        for c in candidates:
            rid = c.info.replica_id
            self.avg_load[rid] = k * self.avg_load.get(rid, 0.0) + (1 - k) * c.load
            self.recent_load[rid] = fast * self.recent_load.get(rid, 0.0) + (1 - fast) * c.load
        return {c.info.replica_id: self.avg_load[c.info.replica_id] for c in candidates}

    def _pending_copies(self, key: bytes, holders: set[str]) -> set[str]:
        """Replicas sent a copy of ``key`` recently that the index does not show yet."""
        if self._decisions % 1024 == 0:  # forget copies of prefixes not seen since
            horizon = self._decisions - max(16, self._window // 8)
            self._copies = {k: v for k, v in self._copies.items()
                            if max(v.values()) >= horizon}
        pending = self._copies.get(key)
        if not pending:
            return set()
        horizon = self._decisions - max(16, self._window // 8)
        for rid in [r for r, at in pending.items() if r in holders or at < horizon]:
            del pending[rid]
        if not pending:
            del self._copies[key]
            return set()
        return set(pending)


def rendezvous_desc(key: bytes, c: Candidate) -> bytes:
    """Rendezvous score inverted, for ``min``: the highest score sorts first."""
    return bytes(255 - b for b in rendezvous_score(key, c.info.replica_id))


class LeastLoaded:
    """The least loaded; ties by :class:`TieOrder`. Also how a router routes while the prefix
    index is unreachable (with no chain: equal loads take turns)."""

    name = "least_loaded"

    def __init__(self) -> None:
        self.ties = TieOrder()

    def choose(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        rank = self.ties.ranks(candidates, chain)
        return min(candidates, key=lambda c: (c.load, rank[c.info.replica_id]))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.info.replica_id)
        return ordered[next(self._counter) % len(ordered)]


# After PrefixAware, which it extends.
from kvfleet.router.predicted_ttft import PredictedTTFT  # noqa: E402

POLICIES: dict[str, Any] = {"prefix_aware": PrefixAware, "predicted_ttft": PredictedTTFT,
                             "least_loaded": LeastLoaded, "round_robin": RoundRobin}


def make_policy(name: str, **options) -> RoutingPolicy:
    """Raises ValueError naming the valid policies. ``options`` go to ``prefix_aware`` and
    ``predicted_ttft`` only (the knobs they share)."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    cls = POLICIES[name]
    return cls(**options) if issubclass(cls, PrefixAware) else cls()
