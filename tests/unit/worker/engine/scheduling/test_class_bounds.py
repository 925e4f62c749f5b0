"""Bounds on the class rules: a lower class takes running seats the tenant share leaves empty
above it, and class preemption cannot take the same sequence without end (docs/slo.md)."""

from __future__ import annotations

from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling import priority_queue
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq, run_step


def seq(level: int, tenant: str = "t", prompt_len: int = 4, max_tokens: int = 8) -> SequenceState:
    return new_seq(prompt_len=prompt_len, max_tokens=max_tokens, tenant=tenant, priority=level)


def test_a_lower_class_takes_the_seats_a_tenant_at_its_share_leaves_empty():
    """4 seats, share 0.5: interactive tenant a runs its 2 and has more waiting; batch tenant
    b waits below it. a may not take a third seat, so b's requests take the two empty ones."""
    s = make_scheduler(256, max_num_seqs=4, tenant_share=0.5)
    a = [seq(INTERACTIVE, "a", max_tokens=50) for _ in range(4)]
    b = [seq(BATCH, "b", max_tokens=50) for _ in range(2)]
    s.add(a + b)
    run_step(s)
    assert [x.status for x in a] == [SeqStatus.RUNNING] * 2 + [SeqStatus.WAITING] * 2
    assert all(x.status is SeqStatus.RUNNING for x in b), "seats left empty under a lower class"
    assert len(s.running) == 4
    # a's next request runs as soon as one of a's own finishes (its share is free again).
    s.finish(a[0])
    run_step(s)
    assert a[2].status is SeqStatus.RUNNING and a[3].status is SeqStatus.WAITING


def test_the_head_class_still_goes_first_while_its_tenant_may_take_a_seat():
    s = make_scheduler(256, max_num_seqs=2, tenant_share=0.5)
    a, b = seq(INTERACTIVE, "a"), seq(BATCH, "b")
    s.add([b])
    s.add([a])
    out = run_step(s)
    assert [x.seq.seq_id for x in out.scheduled] == [a.seq_id, b.seq_id]


def test_class_preemption_takes_one_sequence_a_bounded_number_of_times():
    """One seat: a long batch prompt is preempted by each interactive arrival until it has
    been preempted ``MAX_CLASS_PREEMPTIONS`` times; then the next arrival waits for it."""
    s = make_scheduler(256, max_num_seqs=1, max_num_batched_tokens=8, class_headroom=0)
    long = seq(BATCH, prompt_len=40, max_tokens=4)
    s.add([long])
    taken = 0
    for _ in range(10):
        run_step(s)  # its prefill runs a chunk (8 of 40 tokens)
        assert long.status is SeqStatus.RUNNING
        chat = seq(INTERACTIVE, max_tokens=1)
        s.add([chat])
        out = run_step(s)
        if long.seq_id not in [x.seq_id for x in out.preempted]:
            break
        taken += 1
        assert chat.output_token_ids  # it took the seat and sampled its first token
        s.finish(chat)
    else:
        raise AssertionError("the batch prompt was preempted by every one of 10 arrivals")
    assert taken == priority_queue.MAX_CLASS_PREEMPTIONS == long.class_preemptions
    assert long.status is SeqStatus.RUNNING and chat.status is SeqStatus.WAITING
    while long.status is not SeqStatus.FINISHED:  # it runs to its end, then the arrival runs
        run_step(s)
        if len(long.output_token_ids) >= long.params.max_tokens:
            s.finish(long)
    run_step(s)
    assert chat.status is SeqStatus.RUNNING


def test_a_sequence_preempted_for_blocks_is_not_counted_as_a_class_preemption():
    s = make_scheduler(256, max_num_seqs=2)
    b = seq(BATCH)
    s.add([b])
    run_step(s)
    s.preempt(b)
    assert b.num_preemptions == 1 and b.class_preemptions == 0
