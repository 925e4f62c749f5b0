"""Host KV tier: restore time ÷ prefill time per block and per 1,024-token prefix (SmolLM2, CPU).

    .venv/bin/python -m bench kv_tier [--rounds N] [--quick] [--out FILE]

One run measures, on the same model and machine:

- prefill: one block (16 tokens, no context) and a 1,024-token prefix (64 blocks), one forward;
- restore: the same blocks copied back from the tier into pool blocks, the way a step does it
  (``RankTier.restore`` after a ``TierLookup``), from the in-process store and from the node's
  Ray actor (one object per run through the object store);
- write-back: the engine thread's part (the snapshot copy) and the background put;
- the layout decision: Ray object store put+get one object per block vs one per run;
- peer pull vs recompute of a 1,024-token prefix between two engines (``bench/engine/kv_peer.py``),
  through the in-process store and through the node's Ray actor.

Targets: restore ÷ prefill ≤ 0.1 per block and per prefix (``TARGET``). Medians of ``rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench.common.result_file import RESULTS
from bench.engine.kv_peer import pull_vs_recompute
from kvfleet.deploy.models import prepare_model
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import HostTierStore, TierStore
from kvfleet.worker.runner.model_runner import ModelRunner

BLOCK = 16
PREFIX_BLOCKS = 64  # 1,024 tokens
TARGET = 0.1
PROMPT_TAIL = 8  # tokens after the pulled prefix (bench/engine/kv_peer.py), computed by the receiver


def _median(f: Callable[[], object], rounds: int) -> float:
    f()  # warm
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _prefill(runner: ModelRunner, blocks: int, rounds: int) -> float:
    tokens = torch.randint(0, runner.config.vocab_size, (blocks * BLOCK,),
                           generator=torch.Generator().manual_seed(blocks)).tolist()
    plan = StepPlan((SeqChunk("p", tuple(tokens), 0, tuple(range(blocks))),))
    return _median(lambda: runner.execute(plan), rounds)


def _hashes(n: int, salt: int) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(16, "little") for i in range(n)]


def _tier_times(runner: ModelRunner, store: TierStore, rounds: int) -> dict:
    """Seconds per write-back (engine thread / to the tier) and per restore of 1 and 64 blocks."""
    tier = RankTier(store, 0, runner.kv_cache, max_pending_bytes=1 << 40)
    lookup = TierLookup(store)
    out = {}
    try:
        for n in (1, PREFIX_BLOCKS):
            hashes = _hashes(n, n)
            src, dst = list(range(n)), list(range(PREFIX_BLOCKS, PREFIX_BLOCKS + n))
            tier.save(src, hashes)  # warm the writer
            tier.flush()
            snap = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                tier.save(src, hashes)
                t1 = time.perf_counter()
                tier.flush()
                snap.append((t1 - t0, time.perf_counter() - t0))
            out[f"snapshot_s_{n}"] = statistics.median(s for s, _ in snap)
            out[f"write_back_s_{n}"] = statistics.median(w for _, w in snap)

            def restore(n: int = n, hashes: list[bytes] = hashes, dst: list[int] = dst) -> None:
                assert lookup.lookup(hashes) == n and tier.restore(dst, hashes)

            out[f"restore_s_{n}"] = _median(restore, rounds)
            assert torch.equal(runner.kv_cache.data[:, :, src], runner.kv_cache.data[:, :, dst])
    finally:
        tier.close()
    return out


def _object_store_layout(rounds: int, block_bytes: int) -> dict:
    """Ray object store put+get: 64 objects of one block vs one object of 64 blocks."""
    import ray

    block = np.random.default_rng(0).random(block_bytes // 4, dtype=np.float32)
    run = np.random.default_rng(1).random(PREFIX_BLOCKS * block_bytes // 4, dtype=np.float32)
    per_block = _median(lambda: [ray.get(ray.put(block)) for _ in range(PREFIX_BLOCKS)], rounds)
    per_run = _median(lambda: ray.get(ray.put(run)), rounds)
    return {"object_per_block_s_64": per_block, "object_per_run_s_64": per_run}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench kv_tier", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 rounds, no Ray")
    p.add_argument("--out", type=Path, default=RESULTS / "kv_tier.json")
    a = p.parse_args(argv)
    rounds = 3 if a.quick else a.rounds
    torch.set_num_threads(2)
    model_dir = prepare_model(progress=False)
    runner = ModelRunner(model_dir, num_blocks=2 * PREFIX_BLOCKS + 1, block_size=BLOCK)
    block_bytes = runner.kv_bytes_per_block(runner.config, BLOCK, runner.dtype)
    r: dict = {"model": runner.config.model_type, "block_size": BLOCK, "block_bytes": block_bytes,
               "rounds": rounds, "prefill_s_1": _prefill(runner, 1, rounds),
               f"prefill_s_{PREFIX_BLOCKS}": _prefill(runner, PREFIX_BLOCKS, rounds),
               "tiers": {"in_process": _tier_times(runner, HostTierStore(1 << 30), rounds)},
               "peer": {"in_process": pull_vs_recompute(model_dir, HostTierStore(1 << 30), 0)}}
    if not a.quick:
        import ray

        from kvfleet.deploy.ray_local import init_ray, shutdown_ray
        from kvfleet.worker.kv_tier.node_tier import node_tier

        init_ray(num_cpus=2)
        try:
            tier = node_tier(256 << 20)
            r["tiers"]["ray_actor"] = _tier_times(runner, tier, rounds)
            ray.kill(tier.actor)
            tier = node_tier(256 << 20)
            r["peer"]["ray_actor"] = pull_vs_recompute(model_dir, tier, 1)
            ray.kill(tier.actor)
            r["layout"] = _object_store_layout(rounds, block_bytes)
        finally:
            shutdown_ray()
    for t in r["tiers"].values():
        for n in (1, PREFIX_BLOCKS):
            t[f"ratio_{n}"] = t[f"restore_s_{n}"] / r[f"prefill_s_{n}"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=2))
    print(f"SmolLM2, block {BLOCK} tokens = {block_bytes} B; prefill 1 block "
          f"{r['prefill_s_1'] * 1e3:.1f} ms, {PREFIX_BLOCKS * BLOCK} tokens "
          f"{r[f'prefill_s_{PREFIX_BLOCKS}'] * 1e3:.0f} ms")
    ok = True
    for name, t in r["tiers"].items():
        for n in (1, PREFIX_BLOCKS):
            ok &= t[f"ratio_{n}"] <= TARGET
            print(f"  {name:10s} {n:3d} blocks: restore {t[f'restore_s_{n}'] * 1e3:7.2f} ms "
                  f"= {t[f'ratio_{n}']:.3f} x prefill (target <= {TARGET}); write-back "
                  f"{t[f'snapshot_s_{n}'] * 1e3:.2f} ms on the step, "
                  f"{t[f'write_back_s_{n}'] * 1e3:.1f} ms to the tier")
    for name, peer in r["peer"].items():
        peer["ratio"] = (peer["pull_s"] + peer["restore_and_tail_s"]) / peer["recompute_s"]
        ok &= peer["pulled"] and peer["same_first_token"]
        print(f"  peer pull, {name:10s}: pull {peer['pull_s'] * 1e3:.0f} ms + restore and last "
              f"{PROMPT_TAIL} tokens {peer['restore_and_tail_s'] * 1e3:.0f} ms vs recompute "
              f"{peer['recompute_s'] * 1e3:.0f} ms = {peer['ratio']:.3f}x (pulled: "
              f"{peer['pulled']}, predicted {peer['predicted_pull_s'] * 1e3:.0f} vs "
              f"{peer['predicted_recompute_s'] * 1e3:.0f} ms; same first token: "
              f"{peer['same_first_token']})")
    if "layout" in r:
        lay = r["layout"]
        print(f"  object store, 64 blocks: one object per block "
              f"{lay['object_per_block_s_64'] * 1e3:.1f} ms, one per run "
              f"{lay['object_per_run_s_64'] * 1e3:.1f} ms")
    print(f"wrote {a.out}; {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1
