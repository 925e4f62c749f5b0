"""Window-sized KV: layer groups whose sliding layers release the blocks no token still to
compute can see, through the real Scheduler + Engine + ModelRunner, against transformers'
full-prefix forward (the reference that keeps everything).

Random scenarios (seeded) per model: prompts of random length, some sharing a prefix with an
earlier one (prefix hits), one request sampling ``n=2`` (its siblings copy a shared partial
block before writing: copy-on-write), random chunk widths per step, and a pool small enough
that growing sequences preempt each other (recompute). After every step: the manager's
invariants, and in every sliding group of every running sequence a real block at each entry
the next query can see, holes before. Every logits row the engine computed must match
transformers (``scaled_error <= 1``); across the scenarios blocks must have been released,
and a prefix hit, a copy-on-write and a preemption must each have happened.

Models (block size 4): Gemma 3 with window 4 (one block; 3 layers: two sliding groups and a
full one of one layer each), Gemma 3 with window 7 (not a multiple of the block; 6 layers,
full every 3rd: pages of 2 layers), Mistral with window 3 (below a block; one sliding group).
Chunks of up to 16 tokens are wider than every window.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest

from kvfleet.allocator.kv_cache_manager import NULL_BLOCK, KVCacheManager
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.fixtures.models import GEMMA3_SHAPE, write_windowed_model
from tests.unit.worker.engine.speculative.spec_harness import use_oracle
from tests.unit.worker.engine_harness import (
    BLOCK_SIZE,
    make_engine,
    prompt,
    reference_error,
    request,
    run,
    seq_tokens,
)
from tests.unit.worker.executor.tp.thread_executor import thread_executor

MODELS = {
    "gemma3-w4": ("gemma3_text", dict(GEMMA3_SHAPE, sliding_window=4)),
    "gemma3-w7": ("gemma3_text", dict(GEMMA3_SHAPE, sliding_window=7, num_hidden_layers=6,
                                      sliding_window_pattern=3)),
    "mistral-w3": ("mistral", dict(sliding_window=3)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def windowed(request, tmp_path_factory, smollm2_dir) -> tuple[Path, ModelRunner]:
    """A tiny windowed checkpoint and a runner over its layer groups."""
    family, shape = MODELS[request.param]
    model_dir, groups = write_windowed_model(tmp_path_factory.mktemp(request.param), family,
                                             smollm2_dir, seed=11, **shape)
    return model_dir, ModelRunner(model_dir, num_blocks=300, block_size=BLOCK_SIZE,
                                  layer_groups=groups)


class WindowWatch:
    """After each step: every sliding group's entries from the first block the next query
    sees are real blocks, those before are holes (released); counts the holes."""

    def __init__(self) -> None:
        self.holes = 0
        self.preempted = 0  # steps that began with a preempted sequence waiting

    def __call__(self, k: int, engine: Engine) -> None:
        kv = engine.kv
        self.preempted += any(s.num_preemptions for s in engine.scheduler.waiting)
        for seq in engine.scheduler.running:
            for table, w in zip(kv.block_tables(seq.seq_id), kv.windows, strict=True):
                first = 0 if w is None else max(0, seq.num_computed_tokens - w + 1) // BLOCK_SIZE
                assert NULL_BLOCK not in table[first:], f"{seq.seq_id}: a block it needs is gone"
                if w is not None and seq.num_computed_tokens > 0:
                    # released as soon as the window passed them (the step before computed)
                    assert all(b == NULL_BLOCK for b in table[:first]), f"{seq.seq_id}: kept"
                self.holes += table.count(NULL_BLOCK)


def _scenario(seed: int) -> tuple[dict[int, list], float, Callable[[int], int]]:
    rng = random.Random(seed)
    base = prompt(rng.randint(20, 40), seed=100 + seed)
    reqs = {0: [request(base, max_tokens=rng.randint(6, 14))]}
    for k in (3, 7):
        if rng.random() < 0.6:  # shares a prefix with the first (a hit of whole blocks)
            cut = rng.randint(9, len(base) - 1)
            p = base[:cut] + prompt(rng.randint(1, 12), seed=200 + seed + k)
        else:
            p = prompt(rng.randint(5, 30), seed=300 + seed + k)
        reqs[k] = [request(p, max_tokens=rng.randint(4, 16))]
    reqs[5] = [request(prompt(rng.randint(5, 15), seed=400 + seed), max_tokens=8, n=2,
                       temperature=1.0, seed=seed)]
    widths = [rng.randint(1, 16) for _ in range(400)]
    # Pools of 1.3 and 2 times what the longest sequence may hold force preemptions.
    return reqs, [1.3, 2.0, 4.0][seed % 3], lambda k: widths[k]


def _check_scenarios(model_dir: Path, runner, seeds) -> tuple[WindowWatch, int, int]:
    """Run each seed's scenario; every logits row against transformers. Returns the watch,
    the requests that hit the prefix cache and the block copies made."""
    watch = WindowWatch()
    hits = copies = 0
    for seed in seeds:
        arrivals, pool, budgets = _scenario(seed)
        longest = KVCacheManager(1, BLOCK_SIZE, windows=runner.layer_groups.windows).max_blocks(
            70, 16)
        engine, rec = make_engine(model_dir, num_blocks=int(pool * longest), runner=runner,
                                  watermark=0.0, max_num_batched_tokens=16)
        results = run(engine, arrivals, budgets=budgets, on_step=watch)
        for reqs in arrivals.values():
            for req in reqs:
                for index in range(req.params.n):
                    res = results[(req.request_id, index)]
                    err = reference_error(model_dir, rec, f"{req.request_id}#{index}",
                                          seq_tokens(req, res))
                    assert err <= 1, f"seed {seed} {req.request_id}#{index}: {err:.2f}x tolerance"
                    hits += bool(res.last.usage.cached_prompt_tokens)
        copies += sum(len(p.block_copies) for p in rec.plans)
    return watch, hits, copies


@pytest.mark.parametrize("seeds", [range(3), pytest.param(range(3, 12), marks=pytest.mark.slow)],
                         ids=["3", "slow-9-more"])
def test_windowed_groups_equal_full_recomputation(windowed, seeds) -> None:
    model_dir, runner = windowed
    watch, hits, copies = _check_scenarios(model_dir, runner, seeds)
    assert watch.holes > 0, "no sliding block was ever released"
    assert hits and copies and watch.preempted, (hits, copies, watch.preempted)


def test_windowed_groups_at_tp2(windowed) -> None:
    """The same at tp=2 (thread ranks, real gloo): every rank holds its KV-head shard of every
    group's pages, and the group tables travel in the plan (holes included)."""
    model_dir, runner = windowed
    with thread_executor(model_dir, 2, num_blocks=300, layer_groups=runner.layer_groups) as ex:
        watch, _, copies = _check_scenarios(model_dir, ex, range(1))
    assert watch.holes > 0 and copies


def test_start_up_calibration_runs_over_layer_groups(windowed) -> None:
    """The step-cost calibration's plans carry a table for every group (the runner refuses a
    plan with fewer)."""
    from kvfleet.worker.step_cost.calibration import measure, startup_plans, with_group_tables

    _, runner = windowed
    groups = runner.layer_groups
    plans = startup_plans(runner.num_blocks, BLOCK_SIZE, 256, runner.config.vocab_size)[:3]
    if groups.num_groups > 1:
        with pytest.raises(ValueError, match="layer groups"):
            runner.validate(plans[0])
    samples = measure(runner, [with_group_tables(p, groups.num_groups) for p in plans], repeats=2)
    assert len(samples) == 3


def test_speculative_drafts_over_sliding_groups(windowed) -> None:
    """Verify rows over layer groups: drafts (some rejected, so their blocks are trimmed in
    every group) give the plain run's tokens, every kept logits row equals transformers',
    and the windows still release blocks."""
    model_dir, runner = windowed
    reqs = [request(prompt(9 + 5 * i, seed=60 + i), max_tokens=14) for i in range(4)]
    engine, _ = make_engine(model_dir, num_blocks=200, runner=runner, max_num_batched_tokens=16)
    plain = run(engine, {0: reqs[:2], 2: reqs[2:]})
    refs = {f"{r.request_id}#0": list(r.prompt_token_ids) + plain[(r.request_id, 0)].token_ids
            for r in reqs}
    engine, rec = make_engine(model_dir, num_blocks=200, runner=runner, max_num_batched_tokens=16,
                              speculative="ngram", speculative_tokens=4)
    use_oracle(engine, refs, 4)
    watch = WindowWatch()
    spec = run(engine, {0: reqs[:2], 2: reqs[2:]}, on_step=watch)
    for r in reqs:
        got = spec[(r.request_id, 0)]
        assert got.token_ids == plain[(r.request_id, 0)].token_ids
        err = reference_error(model_dir, rec, f"{r.request_id}#0", seq_tokens(r, got))
        assert err <= 1, f"{r.request_id}: {err:.2f}x the tolerance"
    counts = engine.scheduler.spec.counts
    assert 0 < counts.accepted < counts.drafted  # accepted and rejected drafts both happened
    assert watch.holes > 0
    engine.kv.check_invariants()


def test_reserve_cuts_a_windowed_sequences_chunks_to_half_its_window(windowed) -> None:
    """Under ``reserve`` a sequence's chunks stop at :func:`window_chunk` (half the smallest
    window in blocks, at least a block and a speculative row), so each sliding group's
    promise is the blocks covering ``w - 1 + cap`` positions; every step's tables stay
    within each sequence's promise (the policy never runs out), and the logits equal
    transformers'."""
    from kvfleet.worker.engine.scheduling.blocks import window_chunk

    model_dir, runner = windowed
    reqs = [request(prompt(25 + 9 * i, seed=80 + i), max_tokens=5) for i in range(3)]
    engine, rec = make_engine(model_dir, num_blocks=120, runner=runner, policy="reserve",
                              max_num_batched_tokens=16)
    kv, blocks = engine.kv, engine.scheduler.blocks
    cap = window_chunk(kv.windows, BLOCK_SIZE, 1 + engine.scheduler.config.speculative_tokens)
    assert blocks.chunk_cap == cap and cap is not None and cap < 16
    assert blocks.max_chunk() == cap
    results = run(engine, {0: reqs[:2], 3: reqs[2:]})
    widths = [len(c.token_ids) for p in rec.plans for c in p.chunks]
    assert max(widths) == cap
    totals = {f"{r.request_id}#0": len(r.prompt_token_ids) + 5 for r in reqs}
    for p in rec.plans:
        for c in p.chunks:
            promise = kv.group_max_blocks(totals[c.seq_id], cap)
            held = [sum(b != NULL_BLOCK for b in t) for t in c.tables()]
            assert all(h <= bound for h, bound in zip(held, promise, strict=True)), (held, promise)
    for r in reqs:
        err = reference_error(model_dir, rec, f"{r.request_id}#0",
                              seq_tokens(r, results[(r.request_id, 0)]))
        assert err <= 1, f"{r.request_id}: {err:.2f}x the tolerance"
