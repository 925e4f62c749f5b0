"""The router's credit for host-tier hits, on the virtual-time fleet (``bench/sim/fleet_sim.py``).

Replicas two per node; each node has a host KV tier (an in-process
:class:`~kvfleet.worker.kv_tier.store.HostTierStore` whose residency goes to the in-memory
index exactly as the node actor's does). The cost-model executor gains the tier's moves: an
evicted block is written back (free on the step: the snapshot is ~0.2 % of its prefill), and a
restored block adds ``restore_block_s`` to the step that restores it. The B2B workload
(``bench/common/workload.py``: groups sharing a long system prompt, several users each) at a fixed
rate, three fleets in one run:

* ``tier off``: device pools only;
* ``tier, no credit``: the tier on, the router blind to it (``host_hit_weight`` 0);
* ``tier, credit``: the tier on, host hits credited at ``host_hit_weight`` (default 0.95).

    .venv/bin/python -m bench tier_routing [--replicas 4] [--blocks 192] [--tier-blocks 768]
        [--rate 0.1] [--count 300] [--seed 1]

The defaults: 8 groups × (2,048 + 4 × 256) tokens = 1,536 blocks of shared prompts, twice
the fleet's 768 device blocks; each node's tier holds half of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Sequence

import numpy as np

from bench.common.workload import B2BWorkload, b2b_requests
from bench.sim.fleet_sim import SimFleet, run_sync, summarize
from kvfleet.index_keys import tier_id
from kvfleet.router.policy import make_policy
from kvfleet.router.tier_credit import DEFAULT_HOST_HIT_WEIGHT, RESTORE_BLOCK_S
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import CostModelExecutor
from kvfleet.worker.kv_tier.admission import TierAdmission
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.store import HostTierStore
from kvfleet.worker.step_cost.model import MEASURED

_PLACEHOLDER = np.zeros((1, 1), dtype=np.uint8)  # one byte per block: capacity in blocks


class TierCostExecutor(CostModelExecutor):
    """The cost model with a host tier: write-backs store a placeholder per block, restores
    succeed when the store still holds every block and cost ``restore_block_s`` each on the
    next step."""

    def __init__(self, base: CostModelExecutor, store: HostTierStore, restore_block_s: float):
        super().__init__(base.config, base.cost, int(base._row.argmax()), base.num_blocks,
                         base.block_size, sleep=lambda s: None)
        self.store, self.restore_block_s = store, restore_block_s
        self._restore_s = 0.0

    def transfer_blocks(self, saves, restores) -> bool:
        if saves:
            self.store.put(0, [h for _, h in saves], np.repeat(_PLACEHOLDER, len(saves), axis=0))
        if restores and self.store.get(0, [h for _, h in restores]) is None:
            return False
        self._restore_s += len(restores) * self.restore_block_s
        return True

    def execute(self, plan):
        out = super().execute(plan)
        self.last_step_s += self._restore_s
        self.busy_s += self._restore_s
        self._restore_s = 0.0
        return out


class TierSimFleet(SimFleet):
    """:class:`SimFleet` with a host tier of ``tier_blocks`` blocks per node of
    ``per_node`` replicas (or replica ``i`` on node ``nodes[i]``); the replicas name their
    node's tier in the index (``self.node_of``: replica id → tier id)."""

    def __init__(self, *args, tier_blocks: int, per_node: int = 2, nodes: Sequence[int] = (),
                 restore_block_s: float = RESTORE_BLOCK_S, **kw) -> None:
        super().__init__(*args, **kw)
        self.stores: dict[str, HostTierStore] = {}
        self.node_of: dict[str, str] = {}
        for i, (rid, eng) in enumerate(self.engines.items()):
            node = tier_id(f"node{nodes[i] if nodes else i // per_node}")
            self.node_of[rid] = node
            if node not in self.stores:
                self.stores[node] = HostTierStore(
                    tier_blocks, listener=self.index.tier_publisher(node).record)
            store = self.stores[node]
            eng.executor = TierCostExecutor(eng.executor, store, restore_block_s)
            eng.scheduler.tier = TierAdmission(eng.kv, TierLookup(store))
            pub = self.index.publisher(self.pubs[rid].replica)
            pub.replica = dataclasses.replace(pub.replica, kv_tier=node)
            run_sync(pub.register())
            self.pubs[rid] = pub


def hits_by_tier(fleet: SimFleet) -> dict[str, float]:
    """Prompt tokens reused from each tier ÷ prompt tokens admitted, over the whole run."""
    total = {"prompt_tokens": 0, "device": 0, "host": 0}
    for eng in fleet.engines.values():
        for k, v in eng.stats()["prefix_hits"].items():
            total[k] += v
    return {t: total[t] / max(1, total["prompt_tokens"]) for t in ("device", "host")}


def run(args, model_dir: str) -> dict:
    w = B2BWorkload(groups=args.groups)
    reqs = b2b_requests(w, [(args.rate, args.count)], seed=args.seed)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    out: dict = {"cache_blocks": w.cache_blocks(16), "fleet_blocks": args.replicas * args.blocks}
    fleets = {
        "tier off": lambda: SimFleet(args.replicas, model_dir, args.blocks, MEASURED,
                                     make_policy("prefix_aware"), sched),
        "tier, no credit": lambda: TierSimFleet(
            args.replicas, model_dir, args.blocks, MEASURED,
            make_policy("prefix_aware", host_hit_weight=0.0), sched, tier_blocks=args.tier_blocks),
        "tier, credit": lambda: TierSimFleet(
            args.replicas, model_dir, args.blocks, MEASURED,
            make_policy("prefix_aware", host_hit_weight=args.weight), sched,
            tier_blocks=args.tier_blocks),
    }
    for name, build in fleets.items():
        fleet = build()
        res = fleet.run(reqs, w.output_tokens)
        s = summarize(res, len(res) // 10, args.replicas, fleet.clock)
        s["throughput_rps"] = len(res) / fleet.clock
        s["hit_rate_by_tier"] = hits_by_tier(fleet)
        out[name] = s
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from kvfleet.deploy.models import prepare_model

    p = argparse.ArgumentParser(prog="bench.sim.tier_routing", description=__doc__)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=192, help="KV blocks per replica")
    p.add_argument("--tier-blocks", type=int, default=768, help="host tier blocks per node")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.1, help="requests/s (simulated clock)")
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--weight", type=float, default=DEFAULT_HOST_HIT_WEIGHT)
    p.add_argument("--seed", type=int, default=1, help="arrivals and questions")
    a = p.parse_args(argv)
    print(json.dumps(run(a, str(prepare_model(progress=False))), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
