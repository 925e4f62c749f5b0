"""The class- and service-aware step under an ITL target, with a fake cost model shaped like the
benches' scaled one (16 ms a step, 0.625 ms a prefill token, 4.4 ms a decode row): a higher
class's (or the least-served tenant's) prefill runs without the others' rows, those rows sit
out at most ``MAX_SKIPS`` steps in a row, and nothing is left behind."""

from __future__ import annotations

import random

import pytest

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.class_step import MAX_SKIPS, ROW_SLACK, ClassStep
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.worker.engine.scheduling.seats import TenantSeats
from kvfleet.worker.step_cost.model import CostModel
from tests.unit.worker.engine.scheduling.test_step_budget import step as budget_step
from tests.unit.worker.scheduler_harness import BS, new_seq

COST = CostModel(0.016, 0.000625, 0.0044, "fake: the benches' scaled model")
TARGET_MS = 150.0


def make(class_step: bool = True, max_num_seqs: int = 24, n_blocks: int = 2000,
         target_ms: float = TARGET_MS, **cfg) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, itl_target_ms=target_ms, **cfg)
    return Scheduler(config, KVCacheManager(n_blocks, BS), COST, class_step=class_step)


def step(s: Scheduler) -> SchedulerOutput:
    """:func:`test_step_budget.step` at time 0, then the rule's invariants."""
    out = budget_step(s, 0.0)
    if s.class_step is not None:
        s.class_step.check_invariants(s.skipped, [*s.running, *s.waiting])
    return out


def decoding(s: Scheduler, n: int, **fields) -> list[SequenceState]:
    """``n`` sequences (64-token prompts, long outputs) run until all decode."""
    seqs = [new_seq(prompt_len=64, max_tokens=500, **fields) for _ in range(n)]
    s.add(seqs)
    while any(not x.output_token_ids for x in seqs):
        step(s)
    return seqs


def ran(out: SchedulerOutput) -> set[str]:
    return {x.seq.seq_id for x in out.scheduled}


def test_an_interactive_prefill_runs_without_the_batch_decode_rows():
    s = make()
    batch = decoding(s, 16, priority=BATCH, tenant="b")
    chat = new_seq(prompt_len=64, max_tokens=4, priority=INTERACTIVE, tenant="c")
    s.add([chat])
    out = step(s)
    assert chat.num_computed_tokens == 64 and chat.output_token_ids  # whole prompt, one step
    kept = [b for b in batch if b.seq_id in ran(out)]
    # Only as many batch rows as keep the step within ROW_SLACK × the prompt's own step.
    alone = COST.predict_step_s(0, 64, 64)
    assert COST.step_seconds(out.plan) <= ROW_SLACK * alone
    assert len(kept) == int((ROW_SLACK * alone - alone) / COST.decode_token_s)
    # Off: every batch row rides in the prompt's step.
    s_off = make(class_step=False)
    decoding(s_off, 16, priority=BATCH, tenant="b")
    s_off.add([new_seq(prompt_len=64, max_tokens=4, priority=INTERACTIVE, tenant="c")])
    assert len(step(s_off).scheduled) == 17


def test_no_lower_request_is_admitted_beside_the_favoured_prefill():
    s = make()
    decoding(s, 8, priority=BATCH, tenant="b")
    chat = new_seq(prompt_len=64, max_tokens=4, priority=INTERACTIVE, tenant="c")
    late_batch = new_seq(prompt_len=64, max_tokens=4, priority=BATCH, tenant="b")
    s.add([chat, late_batch])  # seats are free for both
    out = step(s)
    assert chat.seq_id in ran(out) and late_batch.seq_id not in ran(out)
    assert late_batch.seq_id in ran(step(s))  # the next step admits it


def test_lower_rows_sit_out_at_most_max_skips_steps_in_a_row_while_the_prefill_advances():
    s = make(target_ms=40.0)
    batch = decoding(s, 12, priority=BATCH, tenant="b")
    # 400 prompt tokens at <= 38 a step (the 40 ms target): 11 steps or more of favoured prefill.
    chat = new_seq(prompt_len=100, max_tokens=2, priority=INTERACTIVE, tenant="c")
    more = [new_seq(prompt_len=100, max_tokens=2, priority=INTERACTIVE, tenant="c") for _ in range(3)]
    s.add([chat, *more])
    streak = {b.seq_id: 0 for b in batch}
    worst, steps, sat_out = 0, 0, 0
    while any(not x.output_token_ids for x in (chat, *more)):
        before = {x.seq_id: x.num_computed_tokens for x in (chat, *more)}
        out = step(s)
        steps += 1
        assert any(x.num_computed_tokens > before[x.seq_id] for x in (chat, *more)), "no progress"
        for b in batch:
            streak[b.seq_id] = 0 if b.seq_id in ran(out) else streak[b.seq_id] + 1
            worst = max(worst, streak[b.seq_id])
        sat_out += sum(1 for b in batch if b.seq_id not in ran(out))
    assert worst == MAX_SKIPS and sat_out > 0 and steps > MAX_SKIPS + 1


def test_rows_of_the_same_class_and_tenant_never_sit_out():
    s = make()
    rows = decoding(s, 8, tenant="t")
    s.add([new_seq(prompt_len=64, max_tokens=2, tenant="t")])
    out = step(s)
    assert {r.seq_id for r in rows} <= ran(out)


def test_the_least_served_tenants_prefill_runs_without_the_flooders_rows():
    s = make()
    flood = decoding(s, 12, tenant="a")  # a has been served; b arrives one credit below a
    b = new_seq(prompt_len=64, max_tokens=2, tenant="b")
    s.add([b])
    assert s.service.service["b"] == max(0.0, s.service.service["a"] - s.service.credit)
    out = step(s)
    assert b.num_computed_tokens == 64
    assert sum(1 for f in flood if f.seq_id in ran(out)) < len(flood)
    # Once b is ahead (served more than a), a's prefill is favoured and b's row sits out.
    s.service.charge("b", prefill_tokens=10_000)
    a_new = new_seq(prompt_len=64, max_tokens=2, tenant="a")
    s.add([a_new])
    out = step(s)
    assert a_new.num_computed_tokens == 64 and b.seq_id not in ran(out)


def test_random_mixed_classes_and_tenants_finish_and_leave_nothing_behind():
    rng = random.Random(3)
    s = make(max_num_seqs=8, max_num_batched_tokens=96, n_blocks=600)
    pending = [new_seq(prompt_len=rng.randrange(2, 100), max_tokens=rng.randrange(1, 12),
                       priority=rng.choice([INTERACTIVE, 1, BATCH]),
                       tenant=rng.choice("abc")) for _ in range(60)]
    last_run: dict[str, int] = {}
    steps = 0
    while pending or s.num_unfinished:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                s.add([pending.pop()])
        running = list(s.running)
        out = step(s)
        steps += 1
        for sid in ran(out):  # running ones, and those admitted (or readmitted) this step
            last_run[sid] = steps
        for x in running:
            if x.seq_id not in ran(out) and x.status is SeqStatus.RUNNING:  # it sat out
                assert steps - last_run.get(x.seq_id, steps - 1) <= MAX_SKIPS + 1
        assert steps < 5000
    step(s)  # one empty plan drops the counts of sequences that finished meanwhile
    assert s.class_step is not None and s.skipped == {}
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_the_rule_is_off_without_a_target_and_checks_its_bound():
    s = Scheduler(SchedulerConfig(), KVCacheManager(16, BS))
    assert s.class_step is None
    with pytest.raises(ValueError, match="max_skips"):
        ClassStep(COST, 512, TARGET_MS, max_skips=0)
    with pytest.raises(ValueError, match="target_ms"):
        ClassStep(COST, 512, 0.0)


def test_the_rule_s_waiting_candidate_is_admission_s_first_pick(monkeypatch):
    """With a seat free the rule looks up the next waiting sequence; admission takes that
    pick instead of looking it up again (one lookup per admission try, not one more a step)."""
    calls: list[int] = []
    lookup = TenantSeats.next_waiting
    monkeypatch.setattr(TenantSeats, "next_waiting",
                        lambda self, *a: calls.append(1) or lookup(self, *a))
    s = make()
    decoding(s, 4, priority=BATCH, tenant="b")
    chat = new_seq(prompt_len=64, max_tokens=4, priority=INTERACTIVE, tenant="c")
    s.add([chat])
    calls.clear()
    out = step(s)
    assert chat.seq_id in ran(out) and chat.num_computed_tokens == 64
    assert len(calls) == 1  # the rule's lookup; the queue is empty after chat is admitted
