"""Peer pull vs recompute of a 1,024-token prefix, part of ``python -m bench kv_tier``.

Two SmolLM2 engines of one node share a host tier. Replica A has computed a prompt of 1,032
tokens (64 full blocks are reusable). Replica B receives the same prompt:

- recompute: B computes it from scratch (time to its first token);
- pull: B's puller asks A (through A's real engine loop, in process: the gRPC hop is not
  timed) to export the 64 blocks, which A writes back to the tier with its next step; then B
  restores them at admission and computes the last 8 tokens (pull time + B's time to first
  token).

The puller decides with the engine's default step-cost model and the seeded pull cost, as a
replica does; the bench reports its decision and checks that B's first token is the same
both ways.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import tokenizers
import torch

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.peer_pull import PeerHint, PeerPuller, PullCost
from kvfleet.worker.kv_tier.rank_tier import RankTier
from kvfleet.worker.kv_tier.store import TierStore
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.service.engine_loop import EngineLoop
from kvfleet.worker.service.peer_export import InProcessPeer

BLOCK = 16
PROMPT_TOKENS = 1032  # (1032 - 1) // 16 = 64 reusable blocks: the 1,024-token prefix
PREFIX_BLOCKS = 64
POOL_BLOCKS = 72


def _engine(runner: ModelRunner, store: TierStore, model_dir: Path) -> Engine:
    """A fresh engine (empty pool) over ``runner``, writing back to / restoring from ``store``."""
    cfg = runner.config
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return Engine(LocalExecutor(runner, RankTier(store, 0, runner.kv_cache)),
                  KVCacheManager(POOL_BLOCKS, BLOCK), tok, b"bench-kv-peer", cfg.eos_token_ids,
                  cfg.max_position_embeddings, cfg.vocab_size,
                  SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048),
                  tier=TierLookup(store))


def _first_token(engine: Engine, req: EngineRequest) -> tuple[float, int, int]:
    """(seconds to the first token, that token, cached prompt tokens) of ``req`` alone."""
    t0 = time.perf_counter()
    engine.add_request(req)
    while True:
        for o in engine.step():
            if o.finished:
                assert o.usage is not None
                engine.executor.close()
                return time.perf_counter() - t0, o.token_ids[0], o.usage.cached_prompt_tokens


def pull_vs_recompute(model_dir: Path, store: TierStore, round_no: int) -> dict:
    """One measurement over ``store`` (fresh engines; prompt seeded by ``round_no``)."""
    runners = [ModelRunner(model_dir, num_blocks=POOL_BLOCKS, block_size=BLOCK,
                           one_row_weights=False) for _ in range(2)]
    tokens = torch.randint(0, runners[0].config.vocab_size, (PROMPT_TOKENS,),
                           generator=torch.Generator().manual_seed(100 + round_no)).tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def req(rid: str) -> EngineRequest:
        return EngineRequest(f"{rid}-{round_no}", tuple(tokens), params)

    exporter = _engine(runners[0], store, model_dir)
    exporter.add_request(req("a"))
    while exporter.has_work:
        exporter.step()
    recompute_s, token, _ = _first_token(_engine(runners[1], store, model_dir), req("b0"))
    receiver = _engine(runners[1], store, model_dir)
    block_bytes = runners[1].kv_bytes_per_block(runners[1].config, BLOCK, runners[1].dtype)
    predicted: dict = {}

    async def pull() -> tuple[float, EngineRequest, PeerPuller]:
        loop = EngineLoop(exporter, asyncio.get_running_loop())
        puller = PeerPuller(InProcessPeer(loop), receiver.step_cost, receiver.identity_digest,
                            BLOCK, 2048, PullCost(block_bytes))
        predicted.update(predicted_pull_s=puller.cost.predict_s(PREFIX_BLOCKS),
                         predicted_recompute_s=puller.recompute_s(0, PREFIX_BLOCKS))
        loop.start()
        try:
            t0 = time.perf_counter()
            ready = await puller.prepare(req("b1"), PeerHint("a", "in-process", PREFIX_BLOCKS))
            return time.perf_counter() - t0, ready, puller
        finally:
            loop.stop()

    pull_s, ready, puller = asyncio.run(pull())
    restored_s, pulled_token, cached = _first_token(receiver, ready)
    exporter.executor.close()
    return {"recompute_s": recompute_s, "pull_s": pull_s, "restore_and_tail_s": restored_s,
            "pulled": puller.stats.pulls == 1, "cached_prompt_tokens": cached,
            "same_first_token": pulled_token == token, **predicted}
