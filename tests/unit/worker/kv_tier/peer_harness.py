"""Two replicas of one node in process for peer pulls: an exporting engine run by its real
engine loop, and a receiving engine whose puller asks it through :class:`LoopPeer`."""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from kvfleet.worker.kv_tier.peer_client import NodeRelay
from kvfleet.worker.kv_tier.peer_pull import Exported, PeerHint, PeerPuller, PullCost
from kvfleet.worker.kv_tier.store import TierStore
from kvfleet.worker.service.engine_loop import EngineLoop
from kvfleet.worker.service.peer_export import InProcessPeer
from kvfleet.worker.step_cost.model import CostModel, StepCost
from tests.unit.worker.engine_harness import BLOCK_SIZE

# Recompute priced high (10 s a token) so every hinted pull is worth it whatever the load.
SLOW_PREFILL = StepCost(CostModel(1.0, 10.0, 10.0, "test: 10 s a token"), alpha=0.0)
NODE = "node-a"


class LoopPeer(InProcessPeer):
    """The exporting replica in process; ``answer`` may rewrite its answer (a peer that lies)."""

    def __init__(self, loop: EngineLoop,
                 answer: Callable[[tuple[bytes, ...]], tuple[bytes, ...]] = lambda h: h) -> None:
        super().__init__(loop, NODE)
        self.answer = answer

    async def export(self, hint: PeerHint, hashes: Sequence[bytes], timeout_s: float) -> Exported:
        exported = await super().export(hint, hashes, timeout_s)
        return exported._replace(hashes=self.answer(exported.hashes))


def puller(client, engine, max_timeout_s: float = 5.0, node: str = NODE,
           relay=None, tiers=None) -> PeerPuller:
    """A puller for ``engine`` (its identity, block size and budget) over ``client`` (on
    ``node``, copying from other nodes with ``relay``, asking node tiers through ``tiers``)."""
    return PeerPuller(client, SLOW_PREFILL, engine.identity_digest, BLOCK_SIZE,
                      engine.scheduler.config.max_num_batched_tokens, PullCost(1 << 16), node,
                      relay, max_timeout_s=max_timeout_s, tiers=tiers)


class InProcessRelay(NodeRelay):
    """A :class:`NodeRelay` over in-process stores standing in for the nodes' tier actors
    (``stores``: node id → store; an unknown node raises like a missing actor)."""

    def __init__(self, local: TierStore, stores: dict[str, TierStore], ranks=(0,),
                 num_groups: int = 1) -> None:
        super().__init__(local, ranks, num_groups=num_groups)
        self.stores = stores

    def source(self, node_id: str) -> TierStore:
        return self.stores[node_id]


def hint(num_blocks: int, first_block: int = 0) -> PeerHint:
    return PeerHint("a", "in-process", num_blocks, first_block)


async def with_loop(engine, body):
    """Run ``body(loop)`` with ``engine`` on a started engine loop, stopped afterwards."""
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    try:
        return await body(loop)
    finally:
        loop.stop()
