"""The replica's autoscaling report: engine counts, the queue-delay prediction (tokens ×
the engine's forecast), the latency window, and combining the replicas of one host."""

from __future__ import annotations

import pytest

from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.output.outputs import SeqOutput, Timing, Usage
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import ZERO, CostModel
from kvfleet.worker.replica import autoscale as a
from kvfleet.worker.replica.load_report import (
    LatencyWindow,
    combine,
    replica_report,
    revision_id,
)
from kvfleet.worker.replica.replica import ReplicaConfig, build_engine

COST = CostModel(step_base_s=0.1, prefill_token_s=0.001, decode_token_s=0.01)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100)


def finished(ttft_s: float, decode_s: float, tokens: int, index: int = 0) -> SeqOutput:
    from kvfleet.worker.engine.request import FinishReason

    return SeqOutput("r", index, (), "", finish_reason=FinishReason.LENGTH,
                     usage=Usage(10, 0, tokens), timing=Timing(0.0, 0.0, decode_s, ttft_s))


def test_latency_window_p90_and_expiry():
    w = LatencyWindow(window_s=10.0)
    for i in range(10):  # TTFT 0.1..1.0 s; ITL = decode / (tokens - 1)
        w.record(finished(0.1 * (i + 1), 0.9, 10), now=100.0 + i * 0.1)
    w.record(finished(50.0, 0.0, 1, index=1), now=101.0)  # sample 1: not counted
    w.record(finished(7.0, 0.0, 1), now=101.0)  # one output token: a TTFT, no ITL
    ttft, itl = w.p90(now=101.0)
    assert ttft == pytest.approx(1.0) and itl == pytest.approx(0.1)
    assert w.p90(now=111.5) == (0.0, 0.0)
    with pytest.raises(ValueError, match="window_s"):
        LatencyWindow(0)


def test_engine_stats_count_queued_prefill_and_context(tiny_llama_dir):
    cfg = ReplicaConfig("r", "m", str(tiny_llama_dir), num_blocks=64, executor="cost-model",
                        cost_model=ZERO, scheduler=SchedulerConfig(max_num_batched_tokens=32))
    eng = build_engine(cfg)
    params = SamplingParams(max_tokens=4, ignore_eos=True).validate()
    eng.add_request(EngineRequest("a", tuple(range(100, 140)), params))
    eng.add_request(EngineRequest("b", tuple(range(200, 210)), params))
    s = eng.stats()
    assert (s["waiting"], s["prefill_tokens_queued"], s["context_tokens"]) == (2, 50, 0)
    eng.step()  # a: 32 of its 40 prompt tokens computed
    s = eng.stats()
    assert s["running"] == 1 and s["context_tokens"] == 32
    assert s["prefill_tokens_queued"] == (40 - 32) + 10
    report = replica_report(s, cfg.scheduler, LatencyWindow(), 0.25, "v2")
    assert set(report) == set(a.SIGNALS)
    assert report[a.KV_BLOCKS_TOTAL] == 64 and report[a.KV_BLOCKS_USED] == 2
    assert report[a.QUEUE_DELAY_S] == s["queue_delay_s"]  # the forecast routers route on
    assert report[a.REVISION_ID] == revision_id("v2") != revision_id("")


def test_combine_sums_counts_and_keeps_the_worst_latency():
    one = {k: 1.0 for k in a.SIGNALS}
    two = {**one, a.TTFT_P90_S: 3.0, a.RUNNING: 5.0, a.PREFIX_HIT_RATE: 0.5}
    out = combine([one, two])
    assert out[a.RUNNING] == 6.0 and out[a.TTFT_P90_S] == 3.0
    assert out[a.PREFIX_HIT_RATE] == 0.75 and set(out) == set(a.SIGNALS)
    with pytest.raises(ValueError):
        combine([])
