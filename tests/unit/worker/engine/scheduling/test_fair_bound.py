"""With ``tenant_share`` < 1, with or without an ITL target: an over-served tenant's prefill is
bounded by the step-cost model while a less-served tenant of its class has rows
(worker/engine/scheduling/fair_bound.py; real KV cache manager, a fixed linear cost model, no
model, no clock)."""

from __future__ import annotations

import pytest

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.priority import BATCH, DEFAULT
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.scheduling.fair_bound import FairBound, fair_bound, over_served
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.worker.engine.scheduling.step_budget import StepBudget
from kvfleet.worker.step_cost.model import CostModel
from tests.unit.worker.scheduler_harness import BS, new_seq, run_step

# A step: 10 ms, + 4 ms a decode row, + 1 ms a prefill token (no attention term, so a chunk's
# price is its tokens alone and the expected sizes below are exact).
COST = CostModel(step_base_s=0.010, prefill_token_s=0.001, decode_token_s=0.004)
SLACK = 0.5


def make(share: float = 0.5, slack: float | None = SLACK, **cfg) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, tenant_share=share,
                             **cfg)
    return Scheduler(config, KVCacheManager(96, BS), COST, fair_slack=slack)


def seq(tenant: str, prompt_len: int = 8, priority: int = DEFAULT) -> SequenceState:
    return new_seq(prompt_len=prompt_len, max_tokens=4, tenant=tenant, priority=priority)


def step(s: Scheduler) -> SchedulerOutput:
    return run_step(s, finish=True)


def chunks(out: SchedulerOutput) -> dict[str, int]:
    return {x.seq.seq_id: x.num_new_tokens for x in out.scheduled}


def bounded_chunk(decode_rows: int) -> int:
    """Over-served prefill beside ``decode_rows`` rows: SLACK × their step, in whole blocks."""
    seconds = SLACK * (COST.step_base_s + COST.decode_token_s * decode_rows)
    return int(seconds / COST.prefill_token_s + 1e-9) // BS * BS


def serve_a_then_add_b(s: Scheduler) -> tuple[SequenceState, list[SequenceState], SequenceState]:
    """A served first (a 48-token prompt), then B's two prompts and A's 64-token one arrive."""
    a1 = seq("A", prompt_len=48)
    s.add([a1])
    step(s)
    bs, a2 = [seq("B"), seq("B")], seq("A", prompt_len=64)
    s.add([*bs, a2])
    return a1, bs, a2


def a_then_b(**kw) -> tuple[Scheduler, SequenceState, list[SequenceState], SequenceState]:
    """:func:`serve_a_then_add_b`, and the step after: it holds A's prompt back behind B's (the
    whole step's hold-back), so the next has A's row and B's two decoding, and A's long prompt
    waiting (``kw``: :func:`make`'s)."""
    s = make(**kw)
    a1, bs, a2 = serve_a_then_add_b(s)
    out = step(s)
    assert chunks(out) == {a1.seq_id: 1, bs[0].seq_id: 8, bs[1].seq_id: 8}
    assert s.service.service["B"] < s.service.service["A"]
    return s, a1, bs, a2


def test_an_over_served_tenants_prompt_is_bounded_beside_a_less_served_tenants_rows():
    s, a1, bs, a2 = a_then_b()
    out = step(s)
    want = bounded_chunk(decode_rows=3)
    assert 0 < want < 64
    assert chunks(out) == {a1.seq_id: 1, bs[0].seq_id: 1, bs[1].seq_id: 1, a2.seq_id: want}
    # its next chunk, now a running prefill, is bounded the same way
    out = step(s)
    assert chunks(out)[a2.seq_id] == bounded_chunk(decode_rows=3)


def test_without_the_bound_the_prompt_fills_the_budget():
    s, a1, bs, a2 = a_then_b(slack=None)
    assert chunks(step(s))[a2.seq_id] == 64 - 3  # beside the three decode rows


def test_without_a_tenant_share_nothing_is_held_back_or_bounded():
    s = make(share=1.0)
    a1, bs, a2 = serve_a_then_add_b(s)
    out = step(s)
    assert chunks(out) == {a1.seq_id: 1, bs[0].seq_id: 8, bs[1].seq_id: 8, a2.seq_id: 64 - 17}


def test_the_less_served_tenants_prompt_is_never_bounded():
    s = make()
    a1 = seq("A", prompt_len=8)
    s.add([a1])
    step(s)  # A ahead
    b = seq("B", prompt_len=48)
    s.add([b])
    out = step(s)
    assert chunks(out) == {a1.seq_id: 1, b.seq_id: 48}


def test_the_over_served_tenant_alone_in_its_class_is_not_bounded():
    # tenant C (batch) is served most but alone in its class: its prompt fills the budget
    s = make()
    c1, b1 = seq("C", priority=BATCH), seq("B", priority=DEFAULT)
    s.add([c1])
    step(s)
    step(s)
    c2 = seq("C", prompt_len=60, priority=BATCH)
    s.add([b1, c2])
    out = step(s)
    assert over_served([*s.running, *s.waiting], s.service.service) == frozenset()
    # B's prompt beside C's row keeps C's lower-class prompt out of its step (scheduler.py,
    # _not_behind_better); in the next C's whole prompt runs beside the two rows, unbounded
    assert c2.seq_id not in chunks(out)
    assert chunks(step(s))[c2.seq_id] == 60


def test_over_served_compares_within_a_class():
    a, b, c = seq("A"), seq("B"), seq("C", priority=BATCH)
    served = {"A": 10.0, "B": 3.0, "C": 99.0}
    assert over_served([a, b, c], served) == frozenset({(DEFAULT, "A")})
    assert over_served([a, c], served) == frozenset()
    assert over_served([b, seq("B")], served) == frozenset()


def test_the_bound_always_leaves_one_block_and_then_nothing():
    a = seq("A", prompt_len=64)
    bound = FairBound(COST, frozenset({(DEFAULT, "A")}), seconds=0.0, min_tokens=BS)
    assert bound.cap(a, 0, 64) == BS
    bound.take(a, 0, BS)
    assert bound.cap(a, BS, 60) == 0
    assert bound.cap(seq("B"), 0, 8) == 8  # not over-served: untouched
    with pytest.raises(ValueError):
        FairBound(COST, frozenset(), seconds=-1.0, min_tokens=0)


def test_fair_bound_prices_the_decode_rows_that_run():
    s, a1, bs, _ = a_then_b()
    bound = fair_bound(COST, s.running, s.waiting, s.service.service, BS, slack=SLACK)
    assert bound is not None and bound.over == frozenset({(DEFAULT, "A")})
    assert bound.seconds_left == pytest.approx(SLACK * COST.predict_step_s(3, 0, 0))
    sat = fair_bound(COST, s.running, s.waiting, s.service.service, BS,
                     sit_out=frozenset({a1.seq_id}), slack=SLACK)
    assert sat is not None and sat.seconds_left == pytest.approx(
        SLACK * COST.predict_step_s(2, 0, 0))
    assert fair_bound(None, s.running, s.waiting, s.service.service, BS) is None


def test_everything_finishes_and_no_block_leaks_under_the_bound():
    s, *_ = a_then_b()
    s.add([seq("A", prompt_len=64), seq("B", prompt_len=40)])
    for _ in range(200):
        if not s.num_unfinished:
            break
        step(s)
    assert not s.num_unfinished
    assert s.kv.num_free_blocks == 96


# ---- under the ITL target: the same bound, inside the target's own ----------------------------
LOOSE_MS = 1000.0  # a target no step here comes near: only the bound can shorten the step


def test_under_a_loose_target_the_prompt_is_bounded_as_without_one():
    s, a1, bs, a2 = a_then_b(itl_target_ms=LOOSE_MS)
    out = step(s)
    assert chunks(out) == {a1.seq_id: 1, bs[0].seq_id: 1, bs[1].seq_id: 1,
                           a2.seq_id: bounded_chunk(decode_rows=3)}
    assert chunks(step(s))[a2.seq_id] == bounded_chunk(decode_rows=3)


def test_under_a_loose_target_without_the_bound_the_prompt_takes_what_the_target_allows():
    s, a1, bs, a2 = a_then_b(itl_target_ms=LOOSE_MS, slack=None)
    n = chunks(step(s))[a2.seq_id]
    assert n > bounded_chunk(decode_rows=3)  # the control: the bound is what shortened it


def test_under_a_tight_target_the_shorter_of_target_and_bound_wins():
    # beside 3 decode rows (22 ms) the bound allows SLACK × 22 ms = 11 ms of A's prefill
    def grant(target_ms: float) -> int:
        budget = StepBudget(64, BS, COST, target_ms / 1e3)
        budget.reserve_decodes([8, 8, 8])
        budget.fair = FairBound(COST, frozenset({(DEFAULT, "A")}),
                                SLACK * COST.predict_step_s(3, 0, 0), BS)
        return budget.grant(0, 64, seq=seq("A", prompt_len=64))

    assert grant(26.0) == BS  # the target leaves 4 ms: one block, shorter than the bound's
    assert grant(60.0) == bounded_chunk(decode_rows=3)  # the target leaves 38 ms: the bound's
