"""The sharing rule of replica-seconds (``step_cost/share.py``): a step's measured seconds
among its rows, pro rata to their own modelled terms."""

from __future__ import annotations

import math

import pytest

from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.step_cost.model import ZERO, CostModel, StepCost
from kvfleet.worker.step_cost.share import row_cost_s, share_step_s

COST = CostModel(0.01, 0.001, 0.002, "synthetic", 1e-6, draft_token_s=0.0005)


def plan(*chunks: tuple[int, int]) -> StepPlan:
    """Chunks as (new tokens, computed tokens)."""
    return StepPlan(tuple(SeqChunk(f"r{i}", (5,) * n, c, tuple(range(64)))
                          for i, (n, c) in enumerate(chunks)))


def test_the_shares_sum_to_the_steps_measured_seconds():
    p = plan((64, 0), (20, 900), (1, 50), (1, 7))
    shares = share_step_s(COST, p, 0.3)
    assert len(shares) == 4 and math.fsum(shares) == pytest.approx(0.3, rel=1e-12)
    assert min(shares) > 0


def test_a_step_of_one_row_charges_it_all():
    assert share_step_s(COST, plan((1, 50)), 0.042) == [pytest.approx(0.042)]
    assert share_step_s(COST, plan((64, 0)), 0.2) == [pytest.approx(0.2)]
    assert share_step_s(ZERO, plan((64, 0)), 0.2) == [pytest.approx(0.2)]  # no terms at all


def test_a_prefill_row_gets_more_than_a_decode_row_of_the_same_step():
    prefill, decode = share_step_s(COST, plan((64, 0), (1, 64)), 0.2)
    assert prefill > decode
    # pro rata to the own terms: the base is shared in the same proportion
    assert prefill / decode == pytest.approx((64 * 0.001 + 64e-6) / (0.002 + 65e-6))


def test_a_row_pays_for_the_positions_it_attends_and_its_drafts():
    short, long = share_step_s(COST, plan((1, 10), (1, 4000)), 0.1)
    assert long > short
    verify = SeqChunk("v", (5,) * 5, 40, tuple(range(4)), num_draft_tokens=4)
    assert row_cost_s(COST, verify) == pytest.approx(0.002 + 4 * 0.0005 + 45e-6)
    assert share_step_s(ZERO, StepPlan(()), 1.0) == []


def test_the_corrected_model_prices_each_side_at_its_scale():
    """The engine shares with the model as corrected online: a prefill side measured 2x
    makes a prefill row's share grow against a decode row's."""
    cost = StepCost(COST, alpha=0.0)
    cost.log_scales = [0.0, math.log(2.0), 0.0]
    corrected = cost.corrected()
    assert corrected.prefill_token_s == pytest.approx(0.002)
    assert corrected.decode_token_s == COST.decode_token_s
    p = plan((64, 0), (1, 64))
    assert corrected.step_seconds(p) == pytest.approx(cost.predict_plan_s(p))
    before = share_step_s(COST, p, 1.0)[0]
    assert share_step_s(corrected, p, 1.0)[0] > before
