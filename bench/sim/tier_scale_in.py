"""Scale-in with and without the drain hand-over, on the virtual-time fleet.

The B2B workload (``bench/common/workload.py``) runs on 3 replicas with node host tiers
(``bench/sim/tier_routing.py``'s :class:`TierSimFleet`); at ``--at`` seconds replica ``r002`` is
drained as a real one is: no new requests, its streams finish, then

* ``hand-over``: ``Engine.hand_over`` writes its hottest blocks (``BlockPool.hot_blocks``:
  in use, then most recently released) back to its node's tier, as many as the drain budget
  allows at ``--write-back-block-s`` each (what is left of a 30 s drain timeout, at least 1 s,
  as ``ReplicaServer.drain``), and they land after that time; then it deregisters;
* ``no hand-over``: it deregisters, its blocks are lost;
* ``no tier``: the same scale-in on a fleet without host tiers (reference).

Measured: the hit rate (cached ÷ prompt tokens) of the requests arriving in the minute before
the scale-in and in the minute after, and its ratio (target: ≥ 0.8 kept); the device / host
split of the prompt tokens admitted in each minute; TTFT p50 / p90 of each minute.

Two node layouts: ``same-node`` (replicas on nodes 0, 1, 1: survivor r001 shares the drained
replica's node and tier) and ``other-node`` (0, 0, 1: no survivor on its node, so its tier
serves no one after it; only a cross-node pull could use the hand-over).

The cost model's constants, the restore and the write-back are all × ``--scale`` (default
0.1, a machine 10× faster than this one's SmolLM2, as ``autoscale_sim``): at the measured
speed a minute holds ~6 of these requests. Ratios between costs stay as measured.

    .venv/bin/python -m bench tier_scale_in [--seeds 0,1,2] [--rate 1.0] [--at 300]
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path
from typing import Sequence

from bench.common.result_file import RESULTS
from bench.common.workload import B2BWorkload, Request, b2b_requests
from bench.sim.fleet_sim import Result, SimFleet, run_sync
from bench.sim.tier_routing import TierSimFleet
from kvfleet.router.policy import make_policy
from kvfleet.router.tier_credit import RESTORE_BLOCK_S
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.step_cost.model import MEASURED

WRITE_BACK_BLOCK_S = 0.117 / 64  # bench kv_tier: a 64-block write-back to the node actor
DRAIN_TIMEOUT_S = 30.0  # ReplicaConfig.drain_timeout_s's default
LAYOUTS = {"same-node": (0, 1, 1), "other-node": (0, 0, 1)}
MODES = ("hand-over", "no hand-over", "no tier")
WINDOW_S = 60.0


class _ScaleIn:
    """The scale-in on either fleet class: drain ``victim`` at ``at_s``, hand over or not."""

    def setup_scale_in(self, victim: str, at_s: float, hand_over: bool,
                       write_back_block_s: float, coldest_first: bool = False) -> None:
        self.victim, self.at_s, self.hand_over = victim, at_s, hand_over
        self.coldest_first = coldest_first
        self.write_back_block_s = write_back_block_s
        self.draining: set[str] = set()
        self.stopped: set[str] = set()
        self.handed = 0
        self.marks: dict[float, dict[str, int]] = {}

    def _candidates(self, chain):
        return [c for c in super()._candidates(chain)  # type: ignore[misc]
                if c.info.replica_id not in self.draining]

    def _admitted(self) -> dict[str, int]:
        total = {"prompt_tokens": 0, "device": 0, "host": 0}
        for eng in self.engines.values():
            for k, v in eng.stats()["prefix_hits"].items():
                total[k] += v
        return total

    def run(self, reqs: list[Request], output_tokens: int, concurrency: int = 0) -> list[Result]:
        results: dict[str, Result] = {}
        self._closed = None
        for r in reqs:
            self._push(r.offset_s, "arrive", r)
        self._push(self.at_s, "drain", self.victim)
        for t in (self.at_s - WINDOW_S, self.at_s, self.at_s + WINDOW_S):
            self._push(t, "mark", t)
        while self._events:
            self.clock, _, kind, data = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(data, results, output_tokens)
            elif kind == "drain":
                self.draining.add(data)
                self._drain_start = self.clock
                self._maybe_stop(data)
            elif kind == "handed":
                self._handed(*data)
            elif kind == "mark":
                self.marks[data] = self._admitted()
            else:
                self._step_done(*data, results)
                self._maybe_stop(data[0])
        return [results[str(r.index)] for r in reqs]

    def _maybe_stop(self, rid: str) -> None:
        """Once a draining replica is idle: schedule its hand-over's landing (or its end)."""
        if (rid not in self.draining or rid in self.stopped or self.inflight[rid]
                or self.busy[rid]):
            return
        self.stopped.add(rid)  # stays out of routing (draining), never stepped again
        n = 0
        if self.hand_over:
            budget_s = max(1.0, DRAIN_TIMEOUT_S - (self.clock - self._drain_start))
            hot = len(self.engines[rid].kv.pool.hot_blocks())
            n = min(hot, int(budget_s / self.write_back_block_s))
        self._push(self.clock + n * self.write_back_block_s, "handed", (rid, n))

    def _handed(self, rid: str, n: int) -> None:
        eng = self.engines[rid]
        if n and self.coldest_first:  # the same blocks, put in reverse: the hottest land last
            saves = eng.kv.pool.hot_blocks()[:n][::-1]
            eng.executor.transfer_blocks(saves, ())
            self.handed = len(saves)
        elif n:
            self.handed = eng.hand_over(n)  # the real engine's hand-over
        run_sync(self.pubs[rid].deregister())


class ScaleInTierFleet(_ScaleIn, TierSimFleet):
    """A tiered fleet with one scale-in."""


class ScaleInFleet(_ScaleIn, SimFleet):
    """A fleet without tiers with one scale-in."""


def _window(results: Sequence[Result], lo: float, hi: float) -> dict:
    rs = [r for r in results if lo <= r.request.offset_s < hi and r.ttft_s is not None]
    ttft = sorted(r.ttft_s for r in rs if r.ttft_s is not None)
    return {"n": len(rs),
            "hit_rate": sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
            "ttft_p90_s": ttft[int(len(ttft) * 0.9)] if ttft else None}


def _split(a: dict[str, int], b: dict[str, int]) -> dict[str, float]:
    tokens = max(1, b["prompt_tokens"] - a["prompt_tokens"])
    return {t: (b[t] - a[t]) / tokens for t in ("device", "host")}


def run_one(a, model_dir: str, seed: int, layout: str, mode: str) -> dict:
    """One fleet, one seed: the minute before and after the scale-in."""
    w = B2BWorkload(groups=a.groups)
    count = int(a.rate * (a.at + WINDOW_S + 10))
    reqs = b2b_requests(w, [(a.rate, count)], seed=seed)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    cost = MEASURED.scaled(a.scale)
    args = (3, model_dir, a.blocks, cost, make_policy("prefix_aware"), sched)
    fleet: _ScaleIn
    if mode == "no tier":
        fleet = ScaleInFleet(*args)
    else:
        fleet = ScaleInTierFleet(*args, tier_blocks=a.tier_blocks, nodes=LAYOUTS[layout],
                                 restore_block_s=RESTORE_BLOCK_S * a.scale)
    fleet.setup_scale_in("r002", a.at, mode == "hand-over", WRITE_BACK_BLOCK_S * a.scale,
                         a.coldest_first)
    res = fleet.run(reqs, w.output_tokens)
    before = _window(res, a.at - WINDOW_S, a.at)
    after = _window(res, a.at, a.at + WINDOW_S)
    m = fleet.marks
    return {"before": {**before, "admitted_by_tier": _split(m[a.at - WINDOW_S], m[a.at])},
            "after": {**after, "admitted_by_tier": _split(m[a.at], m[a.at + WINDOW_S])},
            "kept": after["hit_rate"] / before["hit_rate"] if before["hit_rate"] else None,
            "handed_over_blocks": fleet.handed}


def main(argv: Sequence[str] | None = None) -> int:
    from kvfleet.deploy.models import prepare_model

    p = argparse.ArgumentParser(prog="bench.sim.tier_scale_in", description=__doc__)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--blocks", type=int, default=512, help="KV blocks per replica")
    p.add_argument("--tier-blocks", type=int, default=1024, help="host tier blocks per node")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (simulated clock)")
    p.add_argument("--at", type=float, default=300.0, help="scale-in time (simulated s)")
    p.add_argument("--coldest-first", action="store_true",
                   help="hand over in reverse (the engine puts hottest first: into a tier "
                        "too small for them, its LRU then drops the hottest)")
    p.add_argument("--scale", type=float, default=0.1, help="factor on every modelled cost")
    p.add_argument("--out", type=Path,
                   default=RESULTS / "tier_scale_in.json")
    a = p.parse_args(argv)
    model_dir = str(prepare_model(progress=False))
    w = B2BWorkload(groups=a.groups)
    out: dict = {"args": {k: str(v) for k, v in vars(a).items()},
                 "cache_blocks": w.cache_blocks(16), "runs": []}
    for layout in a.layouts.split(","):
        for mode in a.modes.split(","):
            if mode == "no tier" and layout != a.layouts.split(",")[0]:
                continue  # no tiers: the layout does not matter
            for seed in (int(s) for s in a.seeds.split(",")):
                r = {"layout": layout if mode != "no tier" else "-", "mode": mode, "seed": seed,
                     **run_one(a, model_dir, seed, layout, mode)}
                out["runs"].append(r)
                print(f"{r['layout']:10s} {mode:13s} seed {seed}: hit rate "
                      f"{r['before']['hit_rate']:.3f} -> {r['after']['hit_rate']:.3f} "
                      f"(kept {r['kept']:.2f}); TTFT p90 {r['before']['ttft_p90_s']:.2f} -> "
                      f"{r['after']['ttft_p90_s']:.2f} s; handed over {r['handed_over_blocks']}",
                      flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
