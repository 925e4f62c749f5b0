"""bench.cluster.soak's report: windows around each fault, unexpected statuses, leaked blocks."""

from __future__ import annotations

from bench.cluster.soak import Outcome, report

FAULTS = [{"fault": "replica kill", "start_s": 10.0, "back_s": 12.0, "replica": "replica-1"},
          {"fault": "redis restart", "start_s": 30.0, "back_s": 31.0}]


def _report(outs, blocks=None):
    blocks = blocks or {"replica-0": {"running": 0, "waiting": 0, "free": 64, "total": 64}}
    return report(outs, FAULTS, 40.0, blocks, {"router": 50 << 20}, {"router": 60 << 20},
                  settle_s=2.0)


def test_ttft_is_split_into_before_during_and_after_each_fault():
    outs = [Outcome("normal", sent, sent + 1, ttft=ttft, code="OK")
            for sent, ttft in ((1, 0.1), (2, 0.3), (3, 0.2), (11, 2.0), (20, 0.2), (32, 0.9), (38, 0.1))]
    outs.append(Outcome("normal", 4, 5, ttft=None, code="UNAVAILABLE"))  # no TTFT: not counted
    r = _report(outs)
    w = r["ttft_by_window"]
    assert list(w) == ["before replica kill", "during replica kill", "after replica kill",
                       "during redis restart", "after redis restart"]
    assert (w["before replica kill"]["normal_ok"], w["before replica kill"]["ttft_p50_ms"],
            w["before replica kill"]["ttft_p99_ms"]) == (3, 200.0, 300.0)
    assert (w["during replica kill"]["start_s"], w["during replica kill"]["end_s"]) == (10.0, 14.0)
    assert w["during replica kill"]["ttft_p99_ms"] == 2000.0
    assert w["after replica kill"]["normal_ok"] == 1
    assert w["during redis restart"]["ttft_p50_ms"] == 900.0
    assert w["after redis restart"]["normal_ok"] == 1
    assert r["rss_mib"] == {"router": {"start": 50.0, "end": 60.0}}
    assert r["restarted"] == ["replica-1"]


def test_statuses_a_kind_may_not_end_with_are_counted_by_where_they_happened():
    outs = [Outcome("normal", 5, 6, code="UNAVAILABLE"),      # before any fault
            Outcome("normal", 9, 11, code="UNAVAILABLE"),     # overlaps the kill
            Outcome("bad", 20, 20.1, code="INVALID_ARGUMENT"),  # expected for its kind
            Outcome("slow", 21, 27, code="OK")]               # a slow reader must be cut off
    r = _report(outs)
    assert r["unexpected"] == {"normal UNAVAILABLE (outside faults)": 1,
                               "normal UNAVAILABLE (in a fault window)": 1,
                               "slow OK (outside faults)": 1}
    assert r["by_kind"]["normal"] == {"UNAVAILABLE": 2}
    assert r["requests"] == 4


def test_blocks_not_back_in_the_free_pool_are_leaked():
    blocks = {"replica-0": {"running": 0, "waiting": 0, "free": 60, "total": 64},
              "replica-1": {"running": 0, "waiting": 0, "free": 64, "total": 64}}
    assert _report([], blocks)["blocks_leaked"] == 4
