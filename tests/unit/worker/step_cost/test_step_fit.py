"""The step-cost fit on fake timings: NNLS, outlier shapes dropped, degenerate constants
clamped to a reference, and the start-up calibration end to end on a fake clock with a noisy
neighbour (never real timings)."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.step_cost import calibration as step_calibration
from kvfleet.worker.step_cost.calibration import CalibrationKey, load_or_calibrate, measure
from kvfleet.worker.step_cost.fit import CLAMP_LO, StepSample, fit, nnls, robust_fit
from kvfleet.worker.step_cost.model import CostModel, attended, plan_shape

TRUE = CostModel(0.01, 0.001, 0.002, "synthetic", 1e-6)
SHAPES = [(1, 0, 17), (8, 0, 136), (1, 0, 1025), (0, 64, attended(0, 64)), (0, 64, attended(1024, 64)),
          (0, 256, attended(0, 256)), (16, 0, 16400)]


def terms(c: CostModel) -> tuple[float, float, float, float]:
    return c.step_base_s, c.prefill_token_s, c.decode_token_s, c.context_token_s


def test_fit_recovers_all_four_constants_in_relative_error():
    samples = [StepSample(p, d, c, TRUE.predict_step_s(d, p, c)) for d, p, c in SHAPES]
    assert terms(fit(samples, "test")) == pytest.approx(terms(TRUE), rel=1e-6)


def test_fit_recovers_the_draft_term_from_verify_steps():
    true = replace(TRUE, draft_token_s=0.0004)
    verify = [(1, 0, 21, 4), (4, 0, 76, 8)]
    samples = [StepSample(p, d, c, true.predict_step_s(d, p, c, v), v)
               for d, p, c, v in [(*s, 0) for s in SHAPES] + verify]
    got = fit(samples, "test")
    assert (*terms(got), got.draft_token_s) == pytest.approx((*terms(true), 0.0004), rel=1e-6)


def test_fit_never_returns_a_negative_constant():
    # Decode steps that get *faster* with context: unconstrained, the context term is negative.
    samples = [StepSample(0, 1, 10, 0.030), StepSample(0, 1, 2000, 0.028), StepSample(0, 8, 80, 0.050),
               StepSample(64, 0, 64, 0.100), StepSample(256, 0, 256, 0.300)]
    got = fit(samples)
    assert got.context_token_s == 0.0 and min(terms(got)) >= 0
    with pytest.raises(ValueError, match="no samples"):
        fit([])


def test_fit_recovers_the_gemm_path_term_from_steps_on_both_sides_of_few_rows():
    """Steps past ``few_rows`` query rows pay a fixed extra (the GEMM path): fitted with
    ``few_rows``, it is recovered beside the other terms; without, no such column (0)."""
    true = replace(TRUE, gemm_step_s=0.004, few_rows=64)
    mixed = [(4, 16, 84), (4, 32, 100), (4, 64, 132)]  # 20 and 36 rows within, 68 past
    samples = [StepSample(p, d, c, true.predict_step_s(d, p, c)) for d, p, c in SHAPES + mixed]
    got = fit(samples, "test", few_rows=64)
    assert (*terms(got), got.gemm_step_s, got.few_rows) == pytest.approx((*terms(true), 0.004, 64), rel=1e-6)
    assert all(got.predict_step_s(s.decode_tokens, s.prefill_tokens, s.context_tokens)
               == pytest.approx(s.seconds, rel=1e-6) for s in samples)
    plain = fit(samples, "test")
    assert plain.gemm_step_s == 0.0 and plain.few_rows == 0


@pytest.mark.parametrize("seed", range(5))
def test_nnls_meets_its_optimality_conditions(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(12, 4, generator=g, dtype=torch.float64)
    b = torch.randn(12, generator=g, dtype=torch.float64)
    x = nnls(a, b)
    grad = a.T @ (b - a @ x)  # KKT: x >= 0, grad <= 0, and grad = 0 where x > 0
    assert bool((x >= 0).all()) and bool((grad <= 1e-9).all())
    assert bool((grad[x > 0].abs() <= 1e-9).all())


def test_an_outlier_shape_is_dropped_and_the_rest_refitted():
    samples = [StepSample(p, d, c, TRUE.predict_step_s(d, p, c)) for d, p, c in SHAPES]
    samples.append(StepSample(32, 4, 200, 5 * TRUE.predict_step_s(4, 32, 200)))  # every repeat hit
    coef, kept = robust_fit(samples)
    assert len(kept) == len(SHAPES) and all(s.seconds < 1 for s in kept)
    assert coef == pytest.approx([*terms(TRUE), 0.0, 0.0], rel=1e-6)  # no drafts, no few_rows: 0


def test_a_degenerate_term_is_clamped_to_the_scaled_reference_and_logged(caplog):
    # A noisy host hid the decode rows (every decode step at the base's time): fitted at 0.
    samples = [StepSample(0, d, c, 0.02) for d, c in ((1, 17), (8, 136), (16, 272))]
    samples += [StepSample(p, 0, p, 0.02 + 0.001 * p) for p in (64, 128, 256)]
    assert fit(samples).decode_token_s == 0.0
    reference = CostModel(0.1, 0.005, 0.01, "reference, 5x slower")  # same ratios as TRUE
    with caplog.at_level(logging.WARNING):
        got = fit(samples, "noisy", reference)
    assert got.decode_token_s > 0 and "clamped" in caplog.text and "decode_token_s" in got.source
    level = got.step_base_s / 0.1  # base and prefill stay as fitted: within the band
    assert got.decode_token_s == pytest.approx(CLAMP_LO * 0.01 * level, rel=0.3)
    assert got.prefill_token_s == pytest.approx(0.001, rel=0.05)
    assert fit(samples[:1] * 4 + samples[3:], "", CostModel(0.1, 0.005, 0.0)).decode_token_s == 0.0


class FakeClockRunner:
    """A runner whose forwards advance a fake clock by ``truth``'s seconds × a noisy neighbour:
    each forward slowed by a few % and, with probability ``p_hit``, 2-6x (never faster)."""

    def __init__(self, truth: CostModel, seed: int, p_hit: float = 0.5) -> None:
        self.truth, self.rng, self.p_hit, self.now = truth, random.Random(seed), p_hit, 0.0
        self.config = SimpleNamespace(max_position_embeddings=2048, vocab_size=1000)
        self.num_blocks, self.block_size = 400, 16

    def perf_counter(self) -> float:
        return self.now

    def execute(self, p: StepPlan) -> torch.Tensor:
        slow = math.exp(abs(self.rng.gauss(0, 0.03)))
        if self.rng.random() < self.p_hit:
            slow *= self.rng.uniform(2, 6)
        self.now += self.truth.predict_step_s(*plan_shape(p)) * slow
        return torch.zeros(len(p.chunks), self.config.vocab_size)


@pytest.mark.parametrize("seed", range(8))
def test_a_noisy_start_up_calibration_still_fits_positive_terms_near_the_truth(seed, monkeypatch):
    runner = FakeClockRunner(TRUE, seed)
    monkeypatch.setattr(step_calibration, "time", SimpleNamespace(perf_counter=runner.perf_counter,
                                                                  strftime=lambda _f: "today"))
    key = CalibrationKey("ab" * 16, "cpu:fake", 1, "float32", 1)
    got = load_or_calibrate(runner, key, None, budget_s=60.0, reference=TRUE.scaled(3))
    base, prefill, decode, context = terms(got)
    assert min(terms(got)) > 0
    assert (base, prefill, decode) == pytest.approx(terms(TRUE)[:3], rel=0.25)
    assert TRUE.context_token_s / 3 < context < 3 * TRUE.context_token_s


@pytest.mark.parametrize("seed", range(4))
def test_a_noisy_start_up_calibration_on_cpu_fits_the_gemm_path_term(seed, monkeypatch):
    """On a CPU key the start-up calibration fits the GEMM-path term at the kernel's reach;
    the chunks an ITL target schedules (decode rows + 16 or 32 tokens) are priced without it."""
    from kvfleet.worker.runner.models.linear import FEW_ROWS

    true = replace(TRUE, gemm_step_s=0.006, few_rows=FEW_ROWS)
    runner = FakeClockRunner(true, seed)
    monkeypatch.setattr(step_calibration, "time", SimpleNamespace(perf_counter=runner.perf_counter,
                                                                  strftime=lambda _f: "today"))
    key = CalibrationKey("ab" * 16, "cpu:fake", 1, "float32", 1)
    got = load_or_calibrate(runner, key, None, budget_s=60.0, reference=TRUE.scaled(3))
    assert got.few_rows == FEW_ROWS
    assert got.gemm_step_s == pytest.approx(0.006, rel=0.5)
    for rows, chunk in ((4, 16), (4, 32), (4, 480)):
        shape = (rows, chunk, rows * 17 + chunk)
        assert got.predict_step_s(*shape) == pytest.approx(true.predict_step_s(*shape), rel=0.25)
    gpu = CalibrationKey("ab" * 16, "cuda:fake", 1, "float32", 1)
    assert load_or_calibrate(runner, gpu, None, budget_s=60.0).few_rows == 0


def test_measure_keeps_each_shapes_fastest_pass_and_needs_two(monkeypatch):
    runner = FakeClockRunner(TRUE, 0, p_hit=1.0)  # every forward 2-6x slow ...
    monkeypatch.setattr(step_calibration, "time", SimpleNamespace(perf_counter=runner.perf_counter))
    plans = step_calibration.startup_plans(runner.num_blocks, runner.block_size, 2048, 1000)
    many = measure(runner, plans, repeats=12)
    few = measure(runner, plans, repeats=2)
    ratios = [[s.seconds / TRUE.step_seconds(p) for s, p in zip(got, plans, strict=True)] for got in (many, few)]
    assert min(ratios[0] + ratios[1]) >= 2.0  # a minimum of slowed forwards is still slowed ...
    assert sum(ratios[0]) < sum(ratios[1])    # ... but more passes find faster ones
    with pytest.raises(ValueError, match="repeats"):
        measure(runner, plans, repeats=1)
