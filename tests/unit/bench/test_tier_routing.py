"""``bench.sim.tier_routing``'s simulated tier: a fleet without one never restores; with one,
groups whose system prompts left the device pools are restored from their node's tier (the
hits by tier count them), with the router blind to the tier or crediting it."""

from __future__ import annotations

from argparse import Namespace

from bench.sim.tier_routing import run


def test_the_simulated_tier_restores_evicted_prompts(smollm2_dir) -> None:
    args = Namespace(replicas=4, blocks=160, tier_blocks=1024, groups=4, rate=0.1, count=24,
                     weight=0.95, seed=1)
    out = run(args, str(smollm2_dir))
    assert out["tier off"]["hit_rate_by_tier"]["host"] == 0.0
    for name in ("tier, no credit", "tier, credit"):
        by_tier = out[name]["hit_rate_by_tier"]
        assert by_tier["host"] > 0.0 and by_tier["device"] > 0.0
        assert out[name]["n"] == out["tier off"]["n"]  # every request finished
