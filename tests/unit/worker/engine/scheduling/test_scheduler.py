"""Scheduler decisions with the real KV cache manager and no model: budgets, FCFS, prefix
reuse, watermark preemption by recompute, the reserve policy, refusal of what never fits."""

from __future__ import annotations

import pytest

from kvfleet.errors import ResourceExhausted
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.config import SchedulerConfig
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from tests.unit.worker.scheduler_harness import ARRIVALS, BS, make_scheduler, new_seq, run_step


def make(n_blocks=16, **cfg) -> Scheduler:
    return make_scheduler(n_blocks, **cfg)


def seq(prompt_len: int, max_tokens: int = 8, first: int = 1, sid: str | None = None) -> SequenceState:
    """A sequence whose prompt is ``first, first + 1, …``: equal ``first`` share a prefix."""
    return new_seq(list(range(first, first + prompt_len)), max_tokens=max_tokens, sid=sid)


def tenant_seq(tenant: str, prompt_len: int = 4) -> SequenceState:
    return new_seq(list(range(1, 1 + prompt_len)), tenant=tenant)


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first():
    s = make(max_num_batched_tokens=6)
    a, b = seq(3), seq(10)
    s.add([a, b])
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [
        (a.seq_id, 3, True), (b.seq_id, 3, False)]
    out = run_step(s)  # a decodes first (1 token), b's prefill fills the rest (5)
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [(a.seq_id, 1), (b.seq_id, 5)]
    assert out.plan.chunks[1].num_computed_tokens == 3
    out = run_step(s)
    assert [(x.seq.seq_id, x.num_new_tokens, x.sample) for x in out.scheduled] == [
        (a.seq_id, 1, True), (b.seq_id, 2, True)]


def test_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2)
    seqs = [seq(2) for _ in range(3)]
    s.add(seqs)
    out = run_step(s)
    assert [x.seq.seq_id for x in out.scheduled] == [seqs[0].seq_id, seqs[1].seq_id]
    assert list(s.waiting) == [seqs[2]]


def test_prefix_hit_reuses_full_blocks_but_recomputes_the_last_prompt_token():
    s = make()
    a = seq(8)
    s.add([a])
    run_step(s)
    s.finish(a)  # its two full blocks stay cached (evictable)
    b = seq(8)  # same tokens: 8 tokens = 2 full blocks, but only 1 may be reused ((8-1)//4)
    s.add([b])
    out = run_step(s)
    assert b.num_cached_tokens == 4
    assert out.plan.chunks[0].num_computed_tokens == 4 and len(out.plan.chunks[0].token_ids) == 4
    c = seq(10)  # 10 tokens: both full blocks reusable
    s.add([c])
    run_step(s)
    assert c.num_cached_tokens == 8


def test_watermark_preempts_the_newest_by_recompute_and_resumes_it_in_fcfs_order():
    s = make(n_blocks=4, watermark=0.0)
    old, new = seq(4, max_tokens=8), seq(4, max_tokens=8, first=50)
    s.add([old, new])
    for _ in range(20):
        out = run_step(s)
        if out.preempted:
            break
    # Both need a 3rd block with none free: the newest is preempted, the oldest keeps going.
    assert out.preempted == (new,) and new.status is SeqStatus.WAITING
    assert [x.seq for x in out.scheduled] == [old]
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    kept = list(new.output_token_ids)
    assert kept  # its output is kept and recomputed, not dropped
    while len(old.output_token_ids) < 8:
        run_step(s)
    s.finish(old)
    out = run_step(s)
    assert out.scheduled[0].seq is new and new.output_token_ids[:len(kept)] == kept
    # prompt + output so far is recomputed (minus whatever full blocks are still cached)
    first = out.plan.chunks[0]
    assert first.num_computed_tokens + len(first.token_ids) == 4 + len(kept)
    assert new.num_cached_tokens == 0  # counted once, at first admission


def test_reserve_never_preempts_and_holds_back_admission():
    s = make(n_blocks=4, policy="reserve")
    a, b = seq(4, max_tokens=8), seq(4, max_tokens=8, first=50)  # each reserves 3 blocks
    s.add([a, b])
    out = run_step(s)
    assert [x.seq for x in out.scheduled] == [a]
    while a.status is SeqStatus.RUNNING and len(a.output_token_ids) < 8:
        out = run_step(s)
        assert not out.preempted
        assert b.status is SeqStatus.WAITING
    s.finish(a)
    run_step(s)
    assert b.status is SeqStatus.RUNNING


def test_never_fitting_request_is_refused_at_once_and_queue_is_bounded():
    s = make(n_blocks=4, max_waiting=2, max_num_seqs=1)
    with pytest.raises(ResourceExhausted, match="4 in total"):
        s.add([seq(10, max_tokens=10)])
    s.add([seq(2), seq(2), seq(2)])  # max_num_seqs + max_waiting = 3, whether running or not
    with pytest.raises(ResourceExhausted, match="queue is full"):
        s.add([seq(2)])


def test_waiting_is_fair_among_tenants_and_fcfs_within_one():
    s = make(n_blocks=64, max_num_seqs=4)
    flood = [tenant_seq("acme") for _ in range(6)]
    trickle = [tenant_seq("globex"), tenant_seq("globex")]
    s.add(flood)
    s.add(trickle)  # queued behind all of acme's
    run_step(s)
    running = [x.seq_id for x in s.running]
    # acme gets one, then globex (0 running) its oldest, then they alternate: 2 each.
    assert running == [flood[0].seq_id, trickle[0].seq_id, flood[1].seq_id, trickle[1].seq_id]
    assert list(s.waiting) == flood[2:]


def test_a_tenant_share_keeps_running_slots_for_other_tenants():
    s = make(n_blocks=64, max_num_seqs=4, tenant_share=0.5)
    flood = [tenant_seq("acme") for _ in range(6)]
    s.add(flood)
    run_step(s)
    assert [x.seq_id for x in s.running] == [f.seq_id for f in flood[:2]]  # 2 of 4 slots
    late = tenant_seq("globex")
    s.add([late])
    run_step(s)
    assert late in s.running and len(s.running) == 3  # admitted at the next step


def test_finish_returns_every_block():
    s = make(n_blocks=8)
    seqs = [seq(5) for _ in range(3)]
    s.add(seqs)
    run_step(s)
    run_step(s)
    for x in seqs:
        s.finish(x)
    assert s.kv.num_free_blocks == 8
    s.kv.check_invariants()


def sibling_group(prompt_len: int, n: int, max_tokens: int = 8) -> list[SequenceState]:
    a = next(ARRIVALS)
    return [SequenceState(seq_id=f"g{a}#{i}", request_id=f"g{a}", index=i,
                     prompt_token_ids=list(range(1, 1 + prompt_len)),
                     params=SamplingParams(max_tokens=max_tokens, n=n), root_hash=b"r" * 16,
                     block_size=BS, arrival_seq=a) for i in range(n)]


def test_siblings_fork_the_computed_prompt_and_copy_the_shared_partial_block():
    s = make(n_blocks=16)
    leader, sib = sibling_group(6, 2)  # 6 tokens: block 0 full, block 1 half full
    s.add([leader, sib])
    assert list(s.waiting) == [leader] and s.num_unfinished == 2
    out = s.schedule()
    assert [(x.seq, x.num_new_tokens, x.sample) for x in out.scheduled] == [(leader, 6, True)]
    forks = s.on_step_done(out)
    assert [(f.leader, f.sibling) for f in forks] == [(leader, sib)]
    assert s.kv.block_table(sib.seq_id) == s.kv.block_table(leader.seq_id) == [0, 1]
    assert sib.num_computed_tokens == 6 and sib.status is SeqStatus.RUNNING
    assert s.kv.ref_count(0) == s.kv.ref_count(1) == 2
    leader.append_token(7)
    sib.append_token(8)
    out = s.schedule()  # the leader writes first: it copies; the sibling then owns block 1 alone
    assert out.plan.block_copies == ((1, 2),)
    assert s.kv.block_table(leader.seq_id) == [0, 2] and s.kv.block_table(sib.seq_id) == [0, 1]
    assert [c.block_table for c in out.plan.chunks] == [(0, 2), (0, 1)]
    s.on_step_done(out)
    s.kv.check_invariants()
    for x in (leader, sib):
        s.finish(x)
    assert s.kv.num_free_blocks == 16


def test_siblings_of_a_block_aligned_prompt_copy_nothing():
    s = make(n_blocks=16)
    group = sibling_group(8, 3)
    s.add(group)
    s.on_step_done(s.schedule())
    for i, x in enumerate(group):
        x.append_token(10 + i)
    out = s.schedule()  # position 8 starts block 2 for each: nothing shared is written
    assert out.plan.block_copies == ()
    assert [c.block_table for c in out.plan.chunks] == [(0, 1, 2), (0, 1, 3), (0, 1, 4)]


def test_unforked_siblings_hold_their_seats():
    s = make(n_blocks=16, max_num_seqs=2)
    leader, sib = sibling_group(10, 2)
    other = seq(3)
    s.add([leader, sib])
    s.add([other])
    out = s.schedule()  # budget left over, but the sibling will need the second seat
    assert [x.seq for x in out.scheduled] == [leader] and list(s.waiting) == [other]
    with pytest.raises(ResourceExhausted, match="max_num_seqs"):
        s.add(sibling_group(2, 3))


def test_siblings_of_a_leader_that_ends_before_its_prompt_go_on_alone():
    s = make(n_blocks=16, max_num_batched_tokens=4)
    leader, sib = sibling_group(10, 2)
    other = seq(3)
    s.add([leader, sib])
    s.add([other])
    s.on_step_done(s.schedule())  # 4 of the leader's 10 prompt tokens
    s.finish(leader)  # e.g. its forward failed
    assert sib.status is SeqStatus.WAITING and list(s.waiting) == [sib, other]
    assert s.kv.num_free_blocks == 16 and not s.pending_forks
    out = s.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(sib, 4)]


@pytest.mark.parametrize("watermark", [-0.1, 1.0, 2.0, float("nan")])
def test_a_watermark_out_of_range_is_refused_at_construction(watermark):
    with pytest.raises(ValueError, match=r"watermark must be in \[0, 1\)"):
        SchedulerConfig(watermark=watermark)
    assert SchedulerConfig(watermark=0.0).watermark == 0.0
