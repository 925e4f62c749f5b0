"""Priority classes in the scheduler (real KV cache manager, no model): class order, tenant
fairness within a class, which running sequences a higher class may preempt, the batch cap."""

from __future__ import annotations

from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.priority_queue import PriorityRules
from kvfleet.worker.engine.scheduling.scheduler import Scheduler
from tests.unit.worker.scheduler_harness import make_scheduler, new_seq
from tests.unit.worker.scheduler_harness import run_step as step


def make(n_blocks: int = 32, **cfg) -> Scheduler:
    # No class headroom by default: these tests take a lower class's seat by preemption
    # (test_class_headroom.py has the seats a better class takes on top first).
    return make_scheduler(n_blocks, **{"class_headroom": 0, **cfg})


def seq(level: int, prompt_len: int = 4, tenant: str = "t", max_tokens: int = 8) -> SequenceState:
    """A sequence of priority ``level`` with a prompt no other sequence shares."""
    return new_seq(prompt_len=prompt_len, max_tokens=max_tokens, tenant=tenant, priority=level)


def ids(seqs) -> list[str]:
    return [x.seq_id for x in seqs]


def test_a_higher_class_is_admitted_before_older_lower_class_requests():
    s = make(max_num_seqs=2)
    b1, b2, d, i = seq(BATCH), seq(BATCH), seq(DEFAULT), seq(INTERACTIVE)
    s.add([b1, b2])
    s.add([d])
    s.add([i])
    assert ids(s.waiting) == ids([i, d, b1, b2])  # class, then FCFS
    out = step(s)
    assert ids(x.seq for x in out.scheduled) == ids([i, d])
    assert b1.status is b2.status is SeqStatus.WAITING


def test_numbers_order_like_classes_and_lower_runs_first():
    s = make(max_num_seqs=1)
    late, early = seq(5), seq(-3)
    s.add([late])
    s.add([early])
    out = step(s)
    assert ids(x.seq for x in out.scheduled) == [early.seq_id]


def test_tenant_fairness_applies_within_the_best_class_only():
    s = make(max_num_seqs=4)
    a_run = seq(INTERACTIVE, tenant="a")
    s.add([a_run])
    step(s)  # tenant a holds one running sequence
    a2, b_batch, a3 = seq(INTERACTIVE, tenant="a"), seq(BATCH, tenant="b"), seq(INTERACTIVE, tenant="a")
    s.add([a2, b_batch, a3])
    # b holds nothing but waits in a lower class: a's interactive requests go first.
    out = step(s)
    assert ids(x.seq for x in out.scheduled if x.seq is not a_run) == ids([a2, a3, b_batch])
    s2 = make(max_num_seqs=2)
    x_run = seq(DEFAULT, tenant="x")
    s2.add([x_run])
    step(s2)
    x2, y1 = seq(DEFAULT, tenant="x"), seq(DEFAULT, tenant="y")
    s2.add([x2, y1])
    out = step(s2)  # one seat left; same class: the tenant with fewer running sequences wins
    assert ids(x.seq for x in out.scheduled if x.seq is not x_run) == [y1.seq_id]


def test_running_sequences_are_served_by_class_so_a_higher_prefill_gets_the_budget_first():
    s = make(max_num_seqs=4, max_num_batched_tokens=16)
    b = seq(BATCH, prompt_len=10)
    s.add([b])
    step(s)  # b's whole prompt: it decodes from now on
    i = seq(INTERACTIVE, prompt_len=40)
    s.add([i])
    out = step(s)  # b's decode first (running), i's first chunk takes the rest
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [(b.seq_id, 1),
                                                                         (i.seq_id, 15)]
    out = step(s)  # both running now: the interactive prefill before the batch decode
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [(i.seq_id, 16)]


def test_a_higher_class_preempts_the_newest_lower_class_sequence():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    streaming = seq(BATCH)
    s.add([streaming])
    step(s)  # prefilled and sampled one token: it has streamed
    prefilling = seq(BATCH, prompt_len=40)
    s.add([prefilling])
    s.schedule()  # admitted; chunk not finished (no sample): nothing streamed
    assert prefilling.status is SeqStatus.RUNNING and not prefilling.output_token_ids
    i = seq(INTERACTIVE)
    s.add([i])
    out = s.schedule()  # no seat: the newest batch request gives its seat up
    assert ids(out.preempted) == [prefilling.seq_id]
    assert prefilling.status is SeqStatus.WAITING and prefilling.num_preemptions == 1
    assert streaming.status is SeqStatus.RUNNING and i.status is SeqStatus.RUNNING
    assert ids(s.waiting) == [prefilling.seq_id]


def test_a_streaming_lower_class_sequence_is_preempted_too_and_keeps_its_tokens():
    s = make(max_num_seqs=1)
    b = seq(BATCH)
    s.add([b])
    step(s)  # b has streamed a token
    i = seq(INTERACTIVE)
    s.add([i])
    out = step(s)
    assert ids(out.preempted) == [b.seq_id] and i.status is SeqStatus.RUNNING
    # Recompute: its streamed token stays, the KV is computed again.
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]


def test_the_same_or_a_higher_class_is_never_preempted_for_a_waiting_one():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    i_run, d_run = seq(INTERACTIVE, prompt_len=40), seq(DEFAULT, prompt_len=40)
    s.add([i_run, d_run])
    s.schedule()
    d_wait = seq(DEFAULT)
    s.add([d_wait])
    out = s.schedule()
    assert out.preempted == () and d_wait.status is SeqStatus.WAITING


def test_a_higher_class_waiting_for_blocks_preempts_the_newest_lowest_class_first():
    # 12 blocks; watermark 0: two batch and one default sequence hold 3 blocks each.
    s = make(n_blocks=12, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0)
    old_b, d, new_b = seq(BATCH, prompt_len=12), seq(DEFAULT, prompt_len=12), seq(BATCH, prompt_len=12)
    for x in (old_b, d, new_b):
        s.add([x])
    s.schedule()  # all three admitted, none sampled yet (chunks end at their prompts: 3 blocks)
    assert s.kv.num_free_blocks == 3
    i = seq(INTERACTIVE, prompt_len=28)  # 7 blocks: two victims needed
    s.add([i])
    out = s.schedule()
    assert ids(out.preempted) == ids([new_b, old_b])  # batch before default, newest first
    assert d.status is SeqStatus.RUNNING and i.status is SeqStatus.RUNNING


def test_reserve_policy_never_preempts_for_a_class():
    s = make(max_num_seqs=1, policy="reserve")
    b = seq(BATCH, prompt_len=40)
    s.add([b])
    s.schedule()
    i = seq(INTERACTIVE)
    s.add([i])
    out = s.schedule()
    assert out.preempted == () and i.status is SeqStatus.WAITING


def test_batch_share_caps_the_batch_band_and_keeps_seats_for_higher_classes():
    s = make(max_num_seqs=4, batch_share=0.5)
    batch = [seq(BATCH) for _ in range(4)]
    s.add(batch)
    step(s)
    assert sum(x.status is SeqStatus.RUNNING for x in batch) == 2  # 0.5 × 4 seats
    d, far = seq(DEFAULT), seq(7)  # priority 7 is in the batch band: capped too
    s.add([d, far])
    step(s)
    assert d.status is SeqStatus.RUNNING and far.status is SeqStatus.WAITING
    assert PriorityRules(4, 0.1).batch_seats == 1  # at least one seat


def test_a_preempted_sequence_returns_to_its_class_and_fcfs_place():
    s = make(max_num_seqs=1)
    b_old = seq(BATCH)
    s.add([b_old])
    step(s)
    b_new, d = seq(BATCH), seq(DEFAULT)
    s.add([b_new])
    s.add([d])
    step(s)  # d preempts b_old, which goes back ahead of the newer batch request
    assert d.status is SeqStatus.RUNNING
    assert ids(s.waiting) == ids([b_old, b_new])


def test_a_burst_of_higher_class_arrivals_takes_its_seats_in_one_step():
    s = make(n_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    batch = [seq(BATCH) for _ in range(4)]
    s.add(batch)
    step(s)  # every seat holds a streaming batch sequence
    burst = [seq(INTERACTIVE) for _ in range(5)]
    s.add(burst)
    out = step(s)
    # 4 tokens each: the token budget (16) fits four first chunks, so four victims, not one
    assert ids(out.preempted) == ids(batch[::-1])
    assert [x.status for x in burst] == [SeqStatus.RUNNING] * 4 + [SeqStatus.WAITING]


def test_a_burst_counts_the_blocks_its_earlier_members_take():
    # 12 blocks, watermark 0: three batch prompts hold 3 blocks each, 3 are free.
    s = make(n_blocks=12, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0)
    batch = [seq(BATCH, prompt_len=12) for _ in range(3)]
    for x in batch:
        s.add([x])
    s.schedule()
    burst = [seq(INTERACTIVE, prompt_len=12) for _ in range(2)]
    s.add(burst)
    out = s.schedule()
    # the first takes the 3 free blocks; the second needs the newest batch sequence's 3
    assert ids(out.preempted) == [batch[-1].seq_id]
    assert all(x.status is SeqStatus.RUNNING for x in burst)


class CountingRules:
    """``PriorityRules`` that note whom each ``victims`` call was for."""

    def __init__(self, rules: PriorityRules) -> None:
        self.rules, self.calls = rules, []

    def __getattr__(self, name: str):
        return getattr(self.rules, name)

    def victims(self, seq: SequenceState, running):
        self.calls.append(seq.seq_id)
        return self.rules.victims(seq, running)


def test_with_a_tenant_share_a_burst_takes_victims_once_per_preemption():
    # 4 seats, share 0.5: tenants a and c each run 2 streaming batch sequences; b's
    # interactive burst of 3 may take 2 seats (its share), preempting the newest two (c's).
    s = make(n_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
             tenant_share=0.5)
    batch = [seq(BATCH, tenant=t) for t in "aacc"]
    s.add(batch)
    step(s)
    assert all(x.status is SeqStatus.RUNNING for x in batch)
    burst = [seq(INTERACTIVE, tenant="b") for _ in range(3)]
    s.add(burst)
    s.rules = counting = CountingRules(s.rules)
    out = step(s)
    assert ids(out.preempted) == ids(batch[::-1][:2])
    assert [x.status for x in burst] == [SeqStatus.RUNNING] * 2 + [SeqStatus.WAITING]
    # One list each: the seat check's serves the preemption (b3 stops at the seat check).
    assert counting.calls == ids(burst)
