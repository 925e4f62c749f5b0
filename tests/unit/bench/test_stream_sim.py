"""bench stream_sim (virtual clock, no wall clock): decode streams beside periodic long
prompts keep the long prompts within 2 × their TTFT without the target, at a target the old
fixed floor missed, and shorten the streams' longest gaps."""

from __future__ import annotations

from bench.sim.itl_sim import IDLE_SMOLLM2
from bench.sim.stream_sim import compare


def test_a_tight_target_keeps_the_long_prompts_within_twice_their_ttft():
    r = compare(IDLE_SMOLLM2, target_x=1.2, seconds=15.0, overhead_s=0.05)
    assert min(r["off"]["long_prompts"], r["on"]["long_prompts"]) >= 9
    assert r["ratios"]["long_ttft_p99"] <= 2.0  # the fixed floor: 2.17
    assert r["on"]["itl_p99_s"] < r["off"]["itl_p99_s"]
    assert r["ratios"]["tokens_per_s"] >= 0.9
