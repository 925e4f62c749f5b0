"""bench/sim/class_sim.py's fairness phases carried on one scheduler, as the cluster bench runs
them on one fleet: each phase starts after the last drained, with its tenant counters."""

from __future__ import annotations

from bench.sim.class_sim import PHASE_GAP_S, Stream, fair_phases, new_scheduler, simulate
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_waiting=256,
                         tenant_share=0.5)
B = Stream("B", rate=4.0, share=0.5)
A = Stream("A", rate=60.0, prompt=256, share=0.5)
V = {"class_step": True}


def test_a_carried_phase_drains_and_the_next_starts_from_its_counters():
    sched = new_scheduler(CONFIG, V)
    alone = simulate([B], CONFIG, 10, 0, variant=V, sched=sched)
    assert alone["_end"] >= 10 and sched.num_unfinished == 0  # drained
    b_alone = sched.service.service["B"]
    assert b_alone > 0
    both = simulate([B, A], CONFIG, 10, 0, variant=V, sched=sched,
                    start=alone["_end"] + PHASE_GAP_S, seq_base=alone["_seqs"])
    assert both["_end"] >= alone["_end"] + PHASE_GAP_S + 10 and sched.num_unfinished == 0
    assert both["_seqs"] > alone["_seqs"]
    # A became backlogged beside B's counter, not at 0: it never starts below B's credit floor
    assert sched.service.service["A"] >= b_alone - sched.service.credit
    assert both["B"]["requests"] > 0 and both["A"]["requests"] > 0


def test_fresh_phases_are_the_runs_alone():
    fresh = fair_phases(CONFIG, 10, 1, None, V, None, False, [B], [B, A])
    assert fresh[0] == simulate([B], CONFIG, 10, 1, variant=V)
    carried = fair_phases(CONFIG, 10, 1, None, V, None, True, [B], [B, A])
    # the alone phase is the same run either way (its drain records nothing)
    assert carried[0]["B"]["ttft_p99_ms"] == fresh[0]["B"]["ttft_p99_ms"]
    assert carried[0]["B"]["requests"] == fresh[0]["B"]["requests"]
