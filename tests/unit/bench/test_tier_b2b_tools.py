"""``tier_b2b_real``'s interleaved configurations, its tier on ÷ off ratios, and the TTFT
breakdown's arithmetic (no fleet: synthetic milestones and tier-call intervals)."""

from __future__ import annotations

import pytest

from bench.cluster.tier_b2b_real import _labels, tier_ratios
from bench.cluster.ttft_breakdown import TtftProbe, _Replica, tail_profile
from kvfleet.worker.engine.output.outputs import Milestones


def test_repeated_configurations_are_numbered_in_order() -> None:
    assert _labels("tier off, tier on,tier off,tier on") == \
        ["tier off #1", "tier on #1", "tier off #2", "tier on #2"]
    assert _labels("tier off,tier on + pull") == ["tier off", "tier on + pull"]
    with pytest.raises(ValueError, match="tier of"):
        _labels("tier off,tier of")


def _run(ttfts: list[float], hit: float) -> dict:
    return {"ttfts_s": ttfts, "hit_rate": hit, "n": len(ttfts)}


def test_ratios_pool_every_run_of_a_kind_and_pair_runs_by_number() -> None:
    runs = {"tier off #1": _run([1.0] * 9 + [4.0], 0.4), "tier on #1": _run([0.5] * 9 + [1.0], 0.8),
            "tier off #2": _run([2.0] * 10, 0.2), "tier on #2": _run([0.5] * 10, 0.8)}
    r = tier_ratios(runs)
    assert r["pairs"]["1"] == {"p50": 0.5, "p90": 0.25, "hit": 2.0}
    assert r["pairs"]["2"] == {"p50": 0.25, "p90": 0.25, "hit": 4.0}
    pooled = r["pooled"]
    assert pooled["tier off"]["n"] == pooled["tier on"]["n"] == 20
    # Pooled off: 9 × 1.0, 10 × 2.0, 1 × 4.0 -> p50 2.0 (index 10), p90 2.0 (index 18).
    assert (pooled["tier off"]["p50"], pooled["tier off"]["p90"]) == (2.0, 2.0)
    assert pooled["tier off"]["hit"] == pytest.approx(0.3)
    assert pooled["on/off"] == {"p50": 0.25, "p90": 0.25, "hit": pytest.approx(0.8 / 0.3)}
    assert tier_ratios({"tier on": _run([1.0], 0.5)}) == {}
    unnumbered = tier_ratios({"tier off": _run([2.0], 0.4), "tier on": _run([1.0], 0.8)})
    assert unnumbered["pairs"]["1"] == {"p50": 0.5, "p90": 0.5, "hit": 2.0}


def test_breakdown_splits_ttft_and_clips_tier_calls_to_the_window() -> None:
    probe = TtftProbe()
    probe.replicas["rep-0"] = _Replica(lookups=[(9.0, 0.5), (10.5, 0.25)],  # 0.0 + 0.25 inside
                                       moves=[(11.0, 0.5), (12.8, 1.0)])    # 0.5 + 0.2 inside
    probe.finals["default/b2b-7"] = ("rep-0", Milestones(
        arrival=10.0, first_scheduled=11.5, first_token=13.0, last_token=13.5, finished=13.5,
        prefill_chunks=((11.5, 256), (12.2, 15))))
    probe.own_restore_s["default/b2b-7"] = 0.5
    parts = probe.breakdown("b2b-7", 3.25)
    assert parts == {"route_s": 0.25, "queue_s": 1.5, "prefill_s": 1.5, "chunks": 2,
                     "tier_lookup_s": 0.25, "tier_move_s": pytest.approx(0.7),
                     "own_restore_s": 0.5}
    assert probe.breakdown("b2b-8", 1.0) == {}     # the worker never reported it
    assert probe.breakdown("b2b-7", None) == {}    # no first token at the client


def test_tail_profile_means_over_all_and_over_the_slowest_tenth() -> None:
    zero = dict.fromkeys(("route_s", "prefill_s", "tier_lookup_s", "tier_move_s",
                          "own_restore_s"), 0.0)
    rows = [{"ttft_s": float(i), "queue_s": float(i)} | zero for i in range(1, 11)]
    p = tail_profile(rows + [{"ttft_s": 99.0}])  # a row without a breakdown is left out
    assert p["tail_n"] == 1 and p["tail"]["queue_s"] == 10.0
    assert p["all"]["ttft_s"] == 5.5
    with pytest.raises(ValueError):
        tail_profile([{"ttft_s": 1.0}])
