"""``predicted_ttft``: route to the replica where the request's first token comes soonest.

Each replica advertises, with its load, ``queue_delay_s`` (seconds before a request arriving
now starts its prefill) and ``prefill_token_s`` (its seconds per uncached prompt token), both
from its own step-cost model (``worker/step_cost/queue_delay.py``). Per candidate, with ``m``
its matched leading blocks of a prompt of ``P`` tokens (blocks its node's host tier holds
after those cost their restore instead of their prefill: ``router/tier_credit.py``):

    predicted TTFT = max(0, queue_delay_s − report age)       the report's backlog, drained since
                   + unreported × pending_s                   this router's requests it misses
                   + (P − m × block_size) × prefill_token_s   the request's own prefill

*unreported* is this router's open streams the report cannot count (its in-flight count
beyond ``reported − settled``, as ``prefix_aware``'s load), each costed at the exponential
average of the prefill seconds this policy predicted for its recent requests to that replica.
``P`` is known to the block: the chain's full blocks plus half a block.

The score ranks the replicas holding the request's **deepest** match (the lowest of
``predicted TTFT + miss_weight × own prefill`` wins: among equally deep holders the slower
one's prefill also delays the requests behind it). It never moves a request to a shallower
holder on its own: a queue that is long at the moment of one decision is a burst that drains
in seconds, while a copy of a prefix is permanent — it costs a full prefill and evicts another
family's blocks (greedy TTFT lost to ``prefix_aware`` and collapsed past saturation:
docs/history/routing.md). Copies come from the bound below, on backlogs averaged over a few
decisions. Ties go to the least loaded, then rendezvous hashing on
the first block.

**What this router sent** (``router/placement_memory.py``). The index shows a block only once
a prefill has computed it, so the blocks of requests this router sent within the copies'
horizon (~32 decisions) count as held by their replica: a family's second request, arriving
while its first prefill is still queued, follows it instead of being placed as new (two
holders of one prefix, each with a share of the fleet's KV). The same record gives each
replica's **working set**: the distinct blocks sent to it over ~``load_window`` decisions per
replica. A new family (no replica holds any block of it) goes where that working set is the
smallest share of the replica's KV — among the replicas whose backlog is shorter than the
prompt's full prefill on the fastest (all, if none is), and after the tenant spread (a light
tenant's request goes where it is least past its even split: ``router/tenant_spread.py``)
— then by load and rendezvous. By
load alone a family lands wherever the queue is short at the moment it first arrives, and
a replica given more families than its KV holds evicts what its own traffic returns for; by
room each replica holds its share. The backlog guard keeps a cold start's prefills off a
replica already busy for longer than the prefill itself (a half-speed one, early); without
the forecast (a replica not yet reported) room places a new family unguarded — by load
there, a burst of new families whose followers the record keeps together piles onto one
replica (docs/history/routing.md has the runs).

What ``prefix_aware`` adds stays, in seconds: the KV-saturation skip; a hot prefix (its own
traffic above ``max_imbalance`` fair shares per holder) gets another holder at once; and the
**bound**: a prefix gets another holder when every holder's backlog (the seconds above,
averaged over ~``BOUND_WINDOW`` (2) decisions per replica) exceeds ``max_imbalance ×`` the
fleet's mean and the mean by ``(1 + miss_weight) ×`` a copy's prefill — the score's exchange
rate. In request counts, as ``prefix_aware`` bounds, a half-speed holder never looks busier,
and past saturation every holder of a long prefix does (B2B: copies that evict, then
thrash). The new holder is the replica lacking the prefix with the lowest score (one holding
part of it is cheaper). When any candidate's report lacks the forecast (an older replica
during a rolling upgrade, or no report), seconds and counts cannot be compared, so that
decision falls back to ``prefix_aware`` (its score and its bound in counts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from kvfleet.index_keys import ReplicaLoad
from kvfleet.router.placement_memory import PlacementMemory
from kvfleet.router.policy import Candidate, PrefixAware, rendezvous_desc
from kvfleet.router.tenant_spread import tenant_excess
from kvfleet.router.tier_credit import host_credit_s

MAX_REPORT_AGE_S = 10.0  # older is a clock offset between hosts, not drained work
DEFAULT_MISS_WEIGHT = 3.0  # see the module docstring (the values tried: docs/history/routing.md)
PENDING_KEEP = 0.75  # weight of the old value in the per-replica average of sent prefill seconds
# Decisions per replica the bound's backlog averages over: the forecast is already the wait a
# request would see, so only a report-to-report jitter is smoothed (a long average hid a slow
# replica's cold-start queue until it had drained: docs/history/routing.md).
BOUND_WINDOW = 2


def report_age(load: Optional[ReplicaLoad], now: float) -> float:
    """Seconds from ``load.updated_at`` (the worker's unix clock) to ``now`` (the router's),
    clamped to [0, ``MAX_REPORT_AGE_S``]; 0 without a report."""
    if load is None:
        return 0.0
    return min(MAX_REPORT_AGE_S, max(0.0, now - load.updated_at))


class PredictedTTFT(PrefixAware):
    """See the module docstring; takes ``prefix_aware``'s options (``load_penalty_blocks``
    only matters in the fallback)."""

    name = "predicted_ttft"

    def __init__(self, miss_weight: float = DEFAULT_MISS_WEIGHT, **options) -> None:
        if miss_weight < 0:
            raise ValueError(f"miss_weight must be >= 0, got {miss_weight}")
        super().__init__(**options)
        self.miss_weight = miss_weight
        self.pending_s: dict[str, float] = {}  # replica → average predicted prefill seconds sent
        self.avg_backlog_s: dict[str, float] = {}  # replica → smoothed backlog (the bound)
        # Index lag over the horizon copies in flight are remembered for (prefix_aware's).
        self.sent = PlacementMemory(horizon=max(16, self._window // 8), window=self._window)
        self._fleet_size = 0  # candidates at the last decision (sets the record's window)

    def choose(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        now = self._decisions + 1
        if len(candidates) != self._fleet_size:  # the working set spans ~load_window per replica
            self._fleet_size = len(candidates)
            self.sent.window = max(self.sent.horizon, self.load_window * len(candidates))
        # Blocks this router sent within the horizon count as held: the index lags a prefill.
        sent = self.sent.matched_by(chain, now)
        seen = [replace(c, matched_blocks=m)
                if (m := sent.get(c.info.replica_id, 0)) > c.matched_blocks
                else c for c in candidates]
        chosen = super().choose(seen, chain)
        rid = chosen.info.replica_id
        self.sent.record(chain, rid, now)
        if _forecast(chosen) is not None:
            own = self.own_prefill_s(chosen, chain)
            self.pending_s[rid] = PENDING_KEEP * self.pending_s.get(rid, own) + (1 - PENDING_KEEP) * own
        # The candidate as the router built it (its index match, for peer hints and logs).
        return next(c for c in candidates if c.info.replica_id == rid)

    def predicted_ttft_s(self, c: Candidate, chain: Sequence[bytes]) -> float:
        """Predicted seconds to ``c``'s first token for ``chain`` (module docstring).
        Raises ValueError when ``c``'s report has no forecast."""
        if _forecast(c) is None:
            raise ValueError(f"replica {c.info.replica_id} advertises no queue delay")
        own = self.own_prefill_s(c, chain)
        return self.backlog_s(c, own) + own

    def backlog_s(self, c: Candidate, default_pending_s: float = 0.0) -> float:
        """Predicted seconds before a request sent to ``c`` now starts its prefill: the
        report's queue delay less its age, plus this router's requests the report misses at
        ``c``'s recent average prefill (``default_pending_s`` before any was sent there).
        Raises ValueError when ``c``'s report has no forecast."""
        forecast = _forecast(c)
        if forecast is None:
            raise ValueError(f"replica {c.info.replica_id} advertises no queue delay")
        queued = max(0.0, forecast.queue_delay_s - c.report_age_s)  # type: ignore[operator]
        reported = 0 if c.reported is None else max(0, c.reported - c.settled)
        unreported = max(0, c.inflight - reported)
        return queued + unreported * self.pending_s.get(c.info.replica_id, default_pending_s)

    def own_prefill_s(self, c: Candidate, chain: Sequence[bytes], matched: Optional[int] = None) -> float:
        """Seconds of the request's uncached prompt tokens on ``c``: with ``matched`` None,
        after its device match (``c.matched_blocks``) and less what its node tier's blocks
        save; else after ``matched`` device blocks, tier ignored (a new copy's cost)."""
        forecast = _forecast(c)
        assert forecast is not None and forecast.prefill_token_s is not None
        bs, m = c.info.block_size, c.matched_blocks if matched is None else matched
        uncached = (len(chain) - min(m, len(chain))) * bs + bs // 2
        per_token = forecast.prefill_token_s
        credit = host_credit_s(c, per_token, self.host_hit_weight) if matched is None else 0.0
        return uncached * per_token - credit

    def _observe_loads(self, candidates: Sequence[Candidate]) -> dict[str, float]:
        """Smoothed loads for the bound: predicted backlog seconds averaged over
        ~``BOUND_WINDOW`` decisions per replica (the score's unit: a replica at half speed is
        twice as loaded at equal counts), or request counts over ~``load_window`` while a
        candidate lacks the forecast."""
        counts = super()._observe_loads(candidates)
        if not all(_forecast(c) is not None for c in candidates):
            return counts
        k = 1.0 - 1.0 / (BOUND_WINDOW * len(candidates))
        for c in candidates:
            rid = c.info.replica_id
            self.avg_backlog_s[rid] = k * self.avg_backlog_s.get(rid, 0.0) + (1 - k) * self.backlog_s(c)
        return {c.info.replica_id: self.avg_backlog_s[c.info.replica_id] for c in candidates}

    def _needs_holder(self, fair_shares: float, holders: set[str], avg: dict[str, float],
                      candidates: Sequence[Candidate], chain: Sequence[bytes]) -> bool:
        """``prefix_aware``'s bound in seconds: holders are overloaded when their smoothed
        backlog exceeds the mean by more than a new copy costs at the score's exchange rate,
        ``(1 + miss_weight) ×`` its prefill on the fastest candidate (in counts a slow holder
        never looked busier, and past saturation every holder did). No warm-up: a forecast
        is not the noise a count one heartbeat old is."""
        if not all(_forecast(c) is not None for c in candidates):
            return super()._needs_holder(fair_shares, holders, avg, candidates, chain)
        if fair_shares > self.max_imbalance * len(holders):
            return True
        copy_s = min(self.own_prefill_s(c, chain, matched=0) for c in candidates)
        return self._overloaded(holders, avg, (1 + self.miss_weight) * copy_s, warm_up=False)

    def _best_score(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        if not any(c.matched_blocks or c.host_blocks for c in candidates):
            return self._place_new(candidates, chain)
        if not all(_forecast(c) is not None for c in candidates):
            return super()._best_score(candidates, chain)
        # Rank only the deepest holders (device blocks, then the node tier's after them).
        best = max(c.matched_blocks + c.host_blocks for c in candidates)
        holders = [c for c in candidates if c.matched_blocks + c.host_blocks == best]
        return min(holders, key=lambda c: self._order(c, chain))

    def _copy_target(self, others: Sequence[Candidate], chain: Sequence[bytes],
                     avg: dict[str, float]) -> Candidate:
        if not all(_forecast(c) is not None for c in others):
            return super()._copy_target(others, chain, avg)
        return min(others, key=lambda c: self._order(c, chain))

    def _place_new(self, candidates: Sequence[Candidate], chain: Sequence[bytes]) -> Candidate:
        """Where a prefix no replica holds goes: among the replicas whose backlog is shorter
        than the prompt's full prefill on the fastest (all, if none is, or if a candidate
        lacks the forecast), the one where the request's tenant would be least past its even
        split (``router/tenant_spread.py``: 0 everywhere unless the tenant is light), then
        whose KV working set has the most room; then least loaded, then
        :class:`~kvfleet.router.policy.TieOrder`."""
        pool = candidates
        if all(_forecast(c) is not None for c in candidates):
            copy_s = min(self.own_prefill_s(c, chain, matched=0) for c in candidates)
            pool = [c for c in candidates if self.backlog_s(c) <= copy_s] or candidates
        rank = self.ties.ranks(pool, chain)
        excess = tenant_excess(pool)
        return min(pool, key=lambda c: (excess[c.info.replica_id],
                                        room_order(self.sent.working_set(c.info.replica_id), c),
                                        c.load, rank[c.info.replica_id]))

    def _order(self, c: Candidate, chain: Sequence[bytes]) -> tuple:
        """Sort key: predicted TTFT + ``miss_weight`` × own prefill; then deeper match,
        least loaded, rendezvous."""
        extra = self.miss_weight * self.own_prefill_s(c, chain)
        return (self.predicted_ttft_s(c, chain) + extra, -c.matched_blocks, c.load,
                rendezvous_desc(chain[0] if chain else b"", c))


def room_order(working_set: int, c: Candidate) -> float:
    """``working_set`` blocks as a share of ``c``'s KV blocks (its last report; 1 block
    without one): the smaller, the more room a new prefix has there."""
    total = c.load_report.num_total_blocks if c.load_report is not None else 0
    return working_set / max(1, total)


def _forecast(c: Candidate) -> Optional[ReplicaLoad]:
    """``c``'s report when it carries the forecast fields, else None."""
    r = c.load_report
    return r if r is not None and r.has_forecast else None
