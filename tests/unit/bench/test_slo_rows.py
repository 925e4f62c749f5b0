"""``bench slo_rows``: the compact table of rows 2 and 3, the rows it accepts, and row 1's
summary of the client's streams."""

from __future__ import annotations

import pytest

from bench.cluster import slo_rows
from bench.cluster.slo_class_rows import table_lines


def test_the_table_has_one_line_per_row_seed_and_setting() -> None:
    r2 = {"alone_p99_ms": 100.0, "both_p99_ms": 140.0, "ratio": 1.4, "batch_alone_per_s": 8.0,
          "batch_both_per_s": 7.3, "batch_drop_per_s": 0.7, "interactive_per_s": 0.8,
          "rs_drop": 0.0812, "rs_interactive": 0.0926, "rs_ratio": 0.0812 / 0.0926,
          "met": True, "load": 1.0}
    r3 = {"alone_p99_ms": None, "both_p99_ms": 300.0, "ratio": None, "admitted": 0.5,
          "met": False, "load": 2.0}
    lines = table_lines({3: {0: {"off": r3}}, 2: {1: {"off": r2, "on": r2}, 0: {"on": r2}}})
    assert [line.split(" |")[0] for line in lines] == [
        "row 2 seed 0 target on ", "row 2 seed 1 target off", "row 2 seed 1 target on ",
        "row 3 seed 0 target off"]
    assert "(1.40x, <= 1.5)" in lines[0] and "lost 0.70 vs interactive 0.80/s" in lines[0]
    assert "batch lost 0.0812 vs interactive 0.0926 replica-s/s (0.88x, <= 1; finished in " \
        "window n/a)" in lines[0]
    assert "(n/a, <= 2.0)" in lines[3] and "B admitted 50%" in lines[3]


@pytest.mark.parametrize("argv", [["--rows", "4"], ["--rows", "2", "--runs", "0"],
                                  ["--rows", "3", "--settings", "both"],
                                  ["--rows", "3", "--settings", ""]])
def test_unknown_rows_settings_and_no_runs_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        slo_rows.main(argv)
    assert exc.value.code == 2


def test_row1_counts_the_tokens_that_arrived_within_the_window() -> None:
    """A request still running at the window's end counts only its tokens so far: 2 of the
    stream's 3 messages and the long prompt's first token arrive within 10 s of the first
    send."""
    stream = slo_rows.Stream("stream", 0, 100.0, [(101.0, 1), (105.0, 2), (111.0, 4)], [1] * 7)
    long = slo_rows.Stream("long", 0, 102.0, [(104.0, 1), (113.0, 1)], [1, 1])
    row = slo_rows.summarize([stream, long], 10.0)
    assert row["tokens_per_s"] == (1 + 2 + 1) / 10.0
    assert row["long_ttft_p50_s"] == 2.0 and row["itl_p50_s"] in (4.0, 6.0)


def test_row2_judges_the_batch_side_on_the_replicas_class_counters() -> None:
    """By the replicas' per-class counters over the middle halves batch took 1.20 replica-s/s
    alone and 1.08 beside a trickle that took 0.135: met (0.12 lost). The completions that
    finished in the window say batch lost 0.20 against 0.135 (a sample in waves): printed, not
    judged; so is the count by admissions (1.0 completions/s lost against 0.9: 1.11x)."""
    from bench.cluster.priority_bench import targets

    def stream(ttft_ms: float, per_s: float, class_rs: float, window_rs: float) -> dict:
        return {"ttft_p99_ms": ttft_ms, "completions_per_s": per_s,
                "class_replica_s_per_s": class_rs, "window_replica_s_per_s": window_rs}

    r = {"interactive_alone": {"chat": stream(100.0, 0.9, 0.09, 0.09)},
         "batch_alone": {"flood": stream(500.0, 10.0, 1.20, 1.20)},
         "both": {"chat": stream(120.0, 0.9, 0.135, 0.135), "flood": stream(600.0, 9.0, 1.08, 1.0)},
         "both_unclassed": {"chat": stream(300.0, 0.9, 0.09, 0.09)}}
    t = targets(r)
    assert t["batch_drop_replica_s_per_s"] == pytest.approx(0.12)
    assert t["interactive_replica_s_per_s"] == pytest.approx(0.135)
    assert t["replica_s_ratio"] == pytest.approx(0.12 / 0.135) and t["throughput_target_met"]
    assert t["window_replica_s_ratio"] == pytest.approx(0.20 / 0.135)
    assert t["completions_ratio"] == pytest.approx(1.0 / 0.9)
    r["both"]["flood"] = stream(600.0, 9.0, 1.0, 1.08)  # the counters: 0.20 lost, missed
    assert not targets(r)["throughput_target_met"]
    assert t["ttft_target_met"] and t["interactive_ttft_p99_ratio"] == pytest.approx(1.2)


def test_counter_rates_difference_the_counters_read_at_the_middle_halfs_edges() -> None:
    """The scrape runs twice, at a quarter and three quarters of the phase; each counter's rate
    is its growth over the time between the reads (a counter first seen at the second read grew
    from 0)."""
    import asyncio
    import time

    from bench.cluster.priority_bench import counter_rates

    reads = iter([{"class:batch": 5.0}, {"class:batch": 5.6, "class:interactive": 0.1}])
    stamps: list[float] = []

    def scrape() -> dict[str, float]:
        stamps.append(time.monotonic())
        return next(reads)

    start = time.monotonic()
    rates = asyncio.run(counter_rates(scrape, start, 0.4))
    assert len(stamps) == 2 and stamps[0] >= start + 0.1 and stamps[1] >= start + 0.3
    elapsed = stamps[1] - stamps[0]
    assert rates["class:batch"] == pytest.approx(0.6 / elapsed, rel=0.2)
    assert rates["class:interactive"] == pytest.approx(0.1 / elapsed, rel=0.2)


def test_settings_runs_only_the_named_target_settings(monkeypatch, tmp_path) -> None:
    """``--settings on`` runs row 2 with the target only, ``off`` row 3 without it; each
    row function gets None (no target) or the class target."""
    from bench.cluster import slo_class_rows

    calls: list[tuple[int, int, object]] = []
    r2 = {"alone_p99_ms": 1.0, "both_p99_ms": 1.0, "ratio": 1.0, "batch_alone_per_s": 1.0,
          "batch_both_per_s": 1.0, "batch_drop_per_s": 0.0, "interactive_per_s": 1.0,
          "rs_drop": 0.0, "rs_interactive": 1.0, "rs_ratio": 0.0, "met": True, "load": 0.0}
    r3 = {"alone_p99_ms": 1.0, "both_p99_ms": 1.0, "ratio": 1.0, "admitted": 1.0, "met": True,
          "load": 0.0}
    monkeypatch.setattr(slo_class_rows, "row2",
                        lambda seed, t, s: calls.append((2, seed, t)) or r2)
    monkeypatch.setattr(slo_class_rows, "row3",
                        lambda seed, t, s: calls.append((3, seed, t)) or r3)
    out = str(tmp_path / "r.json")
    assert slo_rows.main(["--rows", "2", "--settings", "on", "--seed", "4", "--out", out]) == 0
    assert slo_rows.main(["--rows", "3", "--settings", "off", "--runs", "2", "--out", out]) == 0
    assert calls == [(2, 4, 150.0), (3, 0, None), (3, 1, None)]


def test_replica_counters_sum_the_replicas_expositions(monkeypatch) -> None:
    """Two replicas' Prometheus texts: the class counter is summed by class, the step counters
    over everything (another metric sharing a prefix is not read)."""
    from bench.cluster import priority_bench

    def text(batch: float, steps: float) -> str:
        model = 'gen_ai_request_model="m"'
        return "\n".join([
            "# TYPE kvfleet_worker_replica_time_seconds_total counter",
            f'kvfleet_worker_replica_time_seconds_total{{kvfleet_request_priority_class="batch",{model}}} {batch}',
            f'kvfleet_worker_replica_time_seconds_total{{kvfleet_request_priority_class="interactive",{model}}} 0.5',
            f"kvfleet_worker_steps_total{{{model}}} {steps}",
            f"kvfleet_worker_steps_total_other{{{model}}} 99",
            f"kvfleet_worker_step_measured_time_seconds_total{{{model}}} 2.0",
            f"kvfleet_worker_nested_steps_total{{{model}}} 1"])

    monkeypatch.setattr(priority_bench, "replica_metric_texts",
                        lambda _c, strict: [text(3.0, 10), text(1.0, 20)])
    assert priority_bench.replica_counters(None) == {
        "class:batch": 4.0, "class:interactive": 1.0, "forward_s": 4.0, "steps": 30.0, "nested_steps": 2.0}


def test_a_replica_whose_metrics_cannot_be_read_is_an_error_when_strict() -> None:
    """Lenient (the preemption counts): the replica is left out; strict (the rates): an error
    naming it."""
    import types

    from bench.cluster.overload import replica_metric_texts

    cluster = types.SimpleNamespace(metrics_addresses={"router": "x", "replica-0": None})
    assert replica_metric_texts(cluster) == []
    with pytest.raises(RuntimeError, match="replica-0: its metrics could not be read"):
        replica_metric_texts(cluster, strict=True)
