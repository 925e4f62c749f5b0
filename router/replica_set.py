"""The router's view of live replicas: refreshed from the index in the background, with the
router's own in-flight counts and one gRPC channel per replica.

When the index is unreachable the last-known list is kept (docs/design.md §1: route by load over the
replicas it knew) and the outage is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import grpc

from kvfleet.grpc_util import CHANNEL_OPTIONS, WORKER_KEEPALIVE_OPTIONS
from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.inflight import InflightLedger
from kvfleet.router.prefix_index import IndexUnavailable, PrefixIndex
from kvfleet.router.worker_link import WorkerLink
from kvfleet.tls import WORKER_CHANNEL_OPTIONS

log = logging.getLogger(__name__)


class ReplicaSet:
    """``empty_grace_s``: when the registry suddenly lists no replica at all (Redis restarted
    empty or was flushed), keep routing to the last-known ones for this long while they
    re-register (an empty registry is far likelier a lost index than a fleet gone at once).
    ``unreachable_s``: a replica whose stream failed is left out of routing for this long
    (seconds), or until the registry lists it at another address or epoch, unless every
    replica of the model is left out (its registry entry lives until the heartbeat TTL).
    ``identities``: model → the hex cache-identity digest this router hashes with; a replica of
    such a model that advertises another identity (another model directory, e.g. after
    ``kvfleet upgrade --model-dir``, or none) is never routed to, and is logged once and listed
    in :attr:`foreign` (its blocks would never match, its token ids could mean other tokens)."""

    def __init__(self, index: PrefixIndex, refresh_interval_s: float = 0.5,
                 empty_grace_s: float = 10.0, unreachable_s: float = 10.0,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 identities: Optional[dict[str, str]] = None) -> None:
        self.index = index
        self.identities = dict(identities or {})
        self.foreign: dict[str, tuple[str, str]] = {}  # replica id → (model, its identity)
        self.credentials = credentials  # mutual TLS to the workers (kvfleet.tls); None: plaintext
        self.refresh_interval_s = refresh_interval_s
        self.empty_grace_s = empty_grace_s
        self._last_listed = time.monotonic()  # when the registry last listed a replica
        self.replicas: dict[str, tuple[ReplicaInfo, Optional[ReplicaLoad]]] = {}
        self.ledger = InflightLedger()  # this router's streams; how stale each report is
        self.index_available = True
        self.unreachable_s = unreachable_s
        self._unreachable: dict[str, tuple[str, int, float]] = {}  # id → (address, epoch, until)
        self._channels: dict[str, tuple[str, grpc.aio.Channel, WorkerLink]] = {}
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def refresh(self) -> None:
        try:
            live = await self.index.replicas()
        except IndexUnavailable as exc:
            self.mark_index_down(exc)
            return
        self.mark_index_up()
        now = time.monotonic()
        if not live and self.replicas and now - self._last_listed < self.empty_grace_s:
            return  # keep the last-known list (loads already dropped or stale) for a while
        self._last_listed = now
        self.replicas = {info.replica_id: (info, load) for info, load in live}
        self.ledger.on_reports((rid, load) for rid, (_, load) in self.replicas.items())
        self._prune()

    def _prune(self) -> None:
        """Forget what is kept per replica id for ids the registry no longer lists (every
        Serve replacement is a new id): marks, and channels with no call open on them (one
        with open calls goes at a later read, once they ended)."""
        for rid in [r for r in self._unreachable if r not in self.replicas]:
            del self._unreachable[rid]
        for rid, (_, channel, link) in list(self._channels.items()):
            if rid not in self.replicas and not link.open_calls:
                del self._channels[rid]
                asyncio.create_task(_close(channel, link))

    async def routable(self, model: str) -> list[tuple[ReplicaInfo, Optional[ReplicaLoad]]]:
        """:meth:`for_model`, but when that is empty and the index answers, the registry is
        read once first: a replacement may have registered since the last periodic read (every
        ``refresh_interval_s``), e.g. right after the only replica drained. During an outage
        nothing is read (each request would wait for Redis' timeout)."""
        live = self.for_model(model)
        if not live and self.index_available:
            await self.refresh()
            live = self.for_model(model)
        return live

    def mark_index_down(self, exc: BaseException) -> None:
        """Keep the known replicas, forget their load reports (they would freeze): from now on
        load is this router's own in-flight count until the index answers again."""
        if self.index_available:
            log.warning("prefix index unreachable (%s); routing by load over %d known replicas",
                        exc, len(self.replicas))
            self.replicas = {rid: (info, None) for rid, (info, _) in self.replicas.items()}
            self.ledger.on_reports((rid, None) for rid in self.replicas)
        self.index_available = False

    def mark_index_up(self) -> None:
        if not self.index_available:
            log.warning("prefix index reachable again")
        self.index_available = True

    async def _refresh_forever(self) -> None:
        while not self._closed:  # a flag too: a Redis client may swallow the task's cancellation
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("replica refresh failed")

    def for_model(self, model: str) -> list[tuple[ReplicaInfo, Optional[ReplicaLoad]]]:
        """Replicas serving ``model``, without draining ones, nor those marked unreachable
        (unless that is all)."""
        live = [r for r in self.replicas.values()
                if r[0].model == model and r[0].state != "draining"]
        expected = self.identities.get(model)
        if expected is not None:
            live = [r for r in live if self._holds_identity(r[0], expected)]
        if not self._unreachable:
            return live
        reachable = [r for r in live if not self._is_unreachable(r[0])]
        return reachable or live

    def _holds_identity(self, info: ReplicaInfo, expected: str) -> bool:
        if info.identity == expected:
            self.foreign.pop(info.replica_id, None)
            return True
        if self.foreign.get(info.replica_id) != (info.model, info.identity):
            log.warning("replica %s at %s serves model %s under identity %s, this router's is %s: "
                        "not routing to it (router and replica load different model directories)",
                        info.replica_id, info.address, info.model, info.identity[:16] or "(none)",
                        expected[:16])
        self.foreign[info.replica_id] = (info.model, info.identity)
        return False

    def none_reason(self, model: str) -> str:
        """Why :meth:`for_model` is empty, for an UNAVAILABLE message: no replica at all, or
        only replicas whose identity this router does not hold (naming both identities)."""
        live_ids = {rid for rid, (info, _) in self.replicas.items() if info.model == model}
        other = sorted({ident for rid, (m, ident) in self.foreign.items()
                        if m == model and rid in live_ids})
        if not other:
            return f"no live replica serves model {model!r}"
        return (f"no live replica serves model {model!r} under this router's identity "
                f"{self.identities[model][:16]}: {len(live_ids)} replica(s) advertise identity "
                f"{', '.join(o[:16] or '(none)' for o in other)} (the replicas load another model "
                f"directory than this router: restart the routers with it)")

    def mark_unreachable(self, info: ReplicaInfo) -> None:
        """The stream to ``info`` failed, or it refused a request UNAVAILABLE (draining, a failed
        rank): route elsewhere until it re-registers or the mark ends."""
        if info.replica_id not in self._unreachable:
            log.warning("replica %s at %s unreachable; routing around it", info.replica_id,
                        info.address)
        self._unreachable[info.replica_id] = (info.address, info.epoch,
                                              time.monotonic() + self.unreachable_s)

    def is_unreachable(self, info: ReplicaInfo) -> bool:
        """Whether ``info`` is marked unreachable (:meth:`mark_unreachable`) and the mark
        still holds: routing chose it only because every known replica is marked."""
        return self._is_unreachable(info)

    def _is_unreachable(self, info: ReplicaInfo) -> bool:
        mark = self._unreachable.get(info.replica_id)
        if mark is None:
            return False
        address, epoch, until = mark
        if time.monotonic() < until and (address, epoch) == (info.address, info.epoch):
            return True
        del self._unreachable[info.replica_id]  # expired, or a new process registered
        return False

    def link(self, info: ReplicaInfo) -> WorkerLink:
        """The replica's multiplexed call stream at its current address (a new address gets a
        new channel; calls still open on the old one fail with UNAVAILABLE)."""
        cached = self._channels.get(info.replica_id)
        if cached is None or cached[0] != info.address:
            if cached is not None:
                asyncio.create_task(_close(*cached[1:]))
            if self.credentials is None:
                channel = grpc.aio.insecure_channel(info.address,
                                                    options=CHANNEL_OPTIONS + WORKER_KEEPALIVE_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(info.address, self.credentials,
                                                  options=CHANNEL_OPTIONS + WORKER_CHANNEL_OPTIONS
                                                  + WORKER_KEEPALIVE_OPTIONS)
            cached = (info.address, channel, WorkerLink(channel, info.address))
            self._channels[info.replica_id] = cached
        return cached[2]

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        for _, channel, link in self._channels.values():
            await _close(channel, link)
        self._channels.clear()
        await self.index.close()


async def _close(channel: grpc.aio.Channel, link: WorkerLink) -> None:
    await link.close()
    await channel.close()
