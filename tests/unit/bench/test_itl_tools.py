"""The ITL bench's tools: per-step trace records joined to their engine steps, and the
virtual-clock simulation of the ITL target's scheduling (no wall clock anywhere)."""

from __future__ import annotations

import pytest

from bench.engine.step_trace import TracingStepCost, summarize
from bench.sim.itl_sim import simulate
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.step_cost.model import CostModel, StepShape

COST = CostModel(0.01, 0.001, 0.002, "test", 1e-6)


def test_trace_records_each_forward_with_its_steps_wall_time():
    cost = TracingStepCost(COST, alpha=0.0)
    cost.observe(StepShape(4, 0, 400), 0.05)
    cost.step_done(0.06)
    cost.step_done(0.001)  # a step without a forward: nothing to join
    cost.observe(StepShape(2, 100, 300), 0.2)
    cost.step_done(0.21)
    assert [(r.forward_s, r.step_s) for r in cost.records] == [(0.05, 0.06), (0.2, 0.21)]
    assert cost.records[1].predicted_s == pytest.approx(0.01 + 0.004 + 0.1 + 0.0003)
    s = summarize(cost.records, target_s=0.1)
    assert s["decode_only"]["steps"] == 1 and s["with_prefill"]["steps"] == 1
    by_size = {k: v["steps"] for k, v in s["by_prefill_tokens"].items()}
    assert by_size == {"1-32": 0, "33-128": 1, "129-512": 0}
    assert s["over_target"] == 1 and s["forward_s_total"] == pytest.approx(0.25)


def test_the_target_shortens_the_longest_token_gap_on_the_virtual_clock():
    # Four short prompts decode while three long ones prefill behind them.
    long_prompts = [([6] * 16, 60) for _ in range(4)] + [([5] * 400, 20) for _ in range(3)]
    off = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)
    runs = [simulate(long_prompts, c, COST) for c in (off, SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=512, itl_target_ms=80.0))]
    # Off, the short prompts' decodes share steps with up to 512 prefill tokens (~0.4 s); on,
    # steps stay within the 80 ms target but for the floor that keeps each long prompt within
    # the stretch of its time without the target.
    assert runs[0]["itl_p99_s"] > 0.3 > 0.15 > runs[1]["itl_p99_s"]
    assert runs[1]["ttft_p50_s"] < runs[0]["ttft_p50_s"]  # the short prompts no longer wait
