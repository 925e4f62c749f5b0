"""The cost-model executor: step times, the fit, and — the point of it — the same prefix reuse
as the real engine, because only the forward is replaced."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.executor.cost_model import MEASURED, CostModel, CostModelExecutor
from kvfleet.worker.replica.replica import ReplicaConfig, build_engine
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.step_cost.calibration import StepSample, fit
from kvfleet.worker.step_cost.model import plan_shape, with_draft_prior

COST = CostModel(step_base_s=0.01, prefill_token_s=0.001, decode_token_s=0.002)


def plan(*chunks: tuple[int, int]) -> StepPlan:
    """Chunks given as (new tokens, computed tokens), block size 16, tables long enough."""
    return StepPlan(tuple(SeqChunk(f"r{i}", (5,) * n, c, tuple(range(64)))
                          for i, (n, c) in enumerate(chunks)))


def test_step_time_counts_prefill_and_decode_tokens_not_cached_ones():
    p = plan((100, 0), (20, 900), (1, 50), (1, 7))
    assert plan_shape(p)[:2] == (2, 120)  # the 900 cached tokens are not computed
    assert COST.step_seconds(p) == pytest.approx(0.01 + 0.120 + 0.004)
    assert COST.step_seconds(StepPlan(())) == 0.0
    assert COST.scaled(0.5).step_seconds(p) == pytest.approx(COST.step_seconds(p) / 2)


def test_fit_recovers_the_constants_of_a_linear_cost():
    samples = [StepSample(p, d, 0, COST.step_base_s + COST.prefill_token_s * p
                          + COST.decode_token_s * d)
               for p, d in [(512, 0), (64, 0), (16, 0), (0, 1), (0, 8), (0, 16), (128, 4)]]
    got = fit(samples, "test")
    assert (got.step_base_s, got.prefill_token_s, got.decode_token_s) == pytest.approx(
        (COST.step_base_s, COST.prefill_token_s, COST.decode_token_s), rel=1e-6)


def test_measured_constants_are_recorded(tmp_path):
    assert MEASURED.prefill_token_s > 0 and "SmolLM2" in MEASURED.source
    path = tmp_path / "cal.json"
    path.write_text('{"cost_model": {"step_base_s": 1, "prefill_token_s": 2, "decode_token_s": 3}}')
    assert CostModel.load(path).decode_token_s == 3.0


def test_the_context_term_charges_positions_attended():
    with_context = CostModel(0.01, 0.001, 0.002, "test", 1e-6)
    p = plan((20, 900), (1, 50))  # 20 new tokens after 900; one decode row reading 51 positions
    assert with_context.step_seconds(p) == pytest.approx(COST.step_seconds(p) + 1e-6 * (920 + 51))


def test_runner_sleeps_the_modelled_time_and_returns_filler_logits(tiny_llama_dir):
    slept = []
    runner = CostModelExecutor(load_model_config(tiny_llama_dir), COST, filler_token_id=42,
                             num_blocks=64, block_size=16, sleep=slept.append, clock=lambda: 0.0)
    out = runner.execute(plan((30, 0), (1, 40)))
    assert out.shape == (2, runner.config.vocab_size) and out.dtype == torch.float32
    assert out.argmax(dim=1).tolist() == [42, 42]
    assert slept == [pytest.approx(0.01 + 0.030 + 0.002)]


def test_a_pausable_step_sleeps_per_layer_slice_and_resumes_where_it_paused(tiny_llama_dir):
    """3 layers: a step paused after layer 1 sleeps 1/3 of its time, the resume the rest."""
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    runner = CostModelExecutor(load_model_config(tiny_llama_dir), COST, filler_token_id=42,
                               num_blocks=64, block_size=16, sleep=sleep, clock=lambda: now[0])
    step_s = 0.01 + 0.030 + 0.002
    asks = []
    paused = runner.execute_pausable(plan((30, 0), (1, 40)), lambda: asks.append(1) or True)
    assert not isinstance(paused, torch.Tensor) and paused.next_layer == 1 and asks == [1]
    assert now[0] == pytest.approx(step_s / 3)
    now[0] += 5.0  # a nested step ran
    out = runner.resume(paused, lambda: False)
    assert out.shape == (2, runner.config.vocab_size) and out.argmax(dim=1).tolist() == [42, 42]
    assert now[0] == pytest.approx(5.0 + step_s) and runner.steps == 1


def _run(engine, batches):
    """Feed request batches (each waits for the previous one to finish); cached tokens by id."""
    cached = {}
    for batch in batches:
        for rid, prompt in batch:
            engine.add_request(EngineRequest(rid, tuple(prompt),
                                             SamplingParams(max_tokens=5, ignore_eos=True)))
        while engine.has_work:
            for out in engine.step():
                if out.finished:
                    cached[out.request_id] = out.usage.cached_prompt_tokens
        engine.kv.check_invariants()
    return cached


def test_cached_prompt_tokens_equal_the_real_engines(tiny_llama_dir):
    """Same requests, same order, same KV pool: the block pool decides reuse, not the forward."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(48)] for _ in range(4)]
    batches = []
    for b in range(6):  # shared prefixes, concurrent requests, and eviction (16 blocks total)
        batches.append([(f"q{b}-{i}", prefixes[(b + i) % 4][: 16 * (1 + (b + i) % 3)]
                         + [rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 20))])
                        for i in range(3)])
    base = ReplicaConfig(replica_id="x", model_name="tiny", model_dir=str(tiny_llama_dir),
                         block_size=16, num_blocks=16)
    real = _run(build_engine(base), batches)
    modelled = _run(build_engine(replace(base, executor="cost-model", cost_model=CostModel(0, 0, 0))),
                    batches)
    assert modelled == real
    assert sum(real.values()) > 0 and min(real.values()) == 0  # hits and misses both happened


def test_a_replica_calibrates_its_step_cost_once_and_a_cost_model_replica_uses_its_own(tiny_llama_dir,
                                                                                      tmp_path):
    base = ReplicaConfig(replica_id="x", model_name="tiny", model_dir=str(tiny_llama_dir),
                         block_size=16, num_blocks=64, step_cost_dir=str(tmp_path))
    first = build_engine(base).step_cost.prior
    assert first.source.startswith("start-up calibration") and first.step_base_s > 0
    (cached,) = tmp_path.glob("*.json")
    # read, not re-timed (a calibration whose draft fit came out at 0 gets the draft prior on load too)
    assert build_engine(base).step_cost.prior == with_draft_prior(CostModel.load(cached)) == first
    modelled = build_engine(replace(base, executor="cost-model", cost_model=COST))
    # the simulator's engine predicts what it sleeps (a draft priced as a prefill token by both)
    assert modelled.step_cost.prior == with_draft_prior(COST) == modelled.executor.cost
