"""A replica's peer pulls (docs/kv_tier.md, "Peer pull"; a drained replica's tier too): built when it has a
host tier to land them in."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from kvfleet.tls import peer_credentials_loader
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.kv_tier.peer_client import GrpcPeerClient, NodeRelay, TierPeer
from kvfleet.worker.kv_tier.peer_pull import PeerPuller, PullCost
from kvfleet.worker.kv_tier.rank_tier import RankTier

log = logging.getLogger(__name__)


def build_puller(engine: Engine, enabled: bool, tls_dir: Optional[str],
                 capacity_bytes: Optional[int]) -> Optional[PeerPuller]:
    """The puller of ``engine``'s replica, or None: pulls off (``enabled`` false), no host
    tier (``capacity_bytes``: its size), or internal TLS (``tls_dir``) without a replica
    certificate to present to peers (a directory issued before there was one)."""
    tier = engine.executor.tier  # rank 0's side of the host tier
    if not enabled or not isinstance(tier, RankTier) or not capacity_bytes:
        return None
    credentials = peer_credentials_loader(tls_dir) if tls_dir else None
    if tls_dir and credentials is None:
        log.warning("internal TLS directory %s holds no replica certificate: peer pulls are "
                    "off (kvfleet tls renew --dir adds one)", tls_dir)
        return None
    ranks = engine.executor.ranks()
    node_id = ranks[0].node_id if ranks else ""
    all_ranks = list(range(max(1, len(ranks))))
    relay = NodeRelay(tier.store, all_ranks, tag=engine.identity_digest,
                      num_groups=engine.kv.num_groups)
    sched = engine.scheduler.config
    return PeerPuller(GrpcPeerClient(credentials=credentials), engine.step_cost, engine.identity_digest,
                      engine.kv.block_size, sched.max_num_batched_tokens,
                      PullCost(int(np.prod(tier.block_shape))), node_id, relay,
                      tiers=TierPeer(relay.source, all_ranks),
                      adapter_digest=adapter_digest(engine))


def adapter_digest(engine: Engine) -> Optional[Callable[[str], bytes]]:
    """An adapter's chain-root digest at the revision ``engine`` serves now (None: it serves
    no adapter). Raises NotFound for an adapter it does not serve."""
    if engine.adapters is None:
        return None
    return lambda name: engine.lora.digest_for(engine.lora.pin(name))
