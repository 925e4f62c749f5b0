"""The draft-free drafters and the sizing rule, without a model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.speculative.ngram import NgramIndex
from kvfleet.worker.engine.speculative.sizing import (
    CPU_FEW_ROWS,
    Acceptance,
    Candidate,
    FirstByMatch,
    QueryRows,
    query_rows_for,
    size_drafts,
)
from kvfleet.worker.engine.speculative.speculator import Speculator, check_mode
from kvfleet.worker.engine.speculative.suffix import SuffixIndex
from kvfleet.worker.step_cost.model import CostModel, StepCost, StepShape


def _seq(prompt, output=(), root=b"r" * 16, max_tokens=32, **params) -> SequenceState:
    s = SequenceState("s#0", "s", 0, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                      root, 4, 0)
    s.output_token_ids = list(output)
    return s


def test_ngram_copies_after_the_latest_earlier_occurrence_longest_first() -> None:
    def propose(tokens, k):  # one index per token list (it only grows)
        return NgramIndex(min_n=2, max_n=3).propose(tokens, k)

    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 4, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0..2 (followed by 9, 9); (2, 3) last at 6..7 (then 4, 7):
    # the longer match wins.
    assert propose(tokens, 2) == (9, 9)
    assert propose(tokens + [6], 3) == ()  # (3, 6) never seen
    assert propose([5, 6, 5, 6], 4) == (5, 6)  # never the suffix itself
    assert propose([1], 2) == ()


def test_ngram_index_grows_with_the_sequence() -> None:
    idx = NgramIndex(min_n=2, max_n=2)
    tokens = [4, 5, 6]
    assert idx.propose(tokens, 3) == ()
    tokens += [4, 5]
    assert idx.propose(tokens, 3) == (6, 4, 5)


def test_suffix_index_keeps_scopes_apart_and_bounds_memory() -> None:
    idx = SuffixIndex(max_tokens=20, min_n=2, max_n=4)
    idx.add(b"a", [1, 2, 3, 4, 5, 6])
    idx.add(b"b", [1, 2, 7, 8])
    assert idx.propose(b"a", [0, 1, 2], 3) == (2, (3, 4, 5))
    assert idx.propose(b"b", [0, 1, 2], 3) == (2, (7, 8))
    assert idx.propose(b"c", [0, 1, 2], 3) == (0, ())  # another scope's tokens never
    idx.check_invariants()
    for i in range(5):  # 5 × 5 tokens: the oldest documents go
        idx.add(b"a", [10 + i, 11 + i, 12 + i, 13 + i, 14 + i])
        idx.check_invariants()
    assert idx.num_tokens <= 20
    assert idx.propose(b"b", [1, 2], 3) == (0, ())  # evicted with its n-grams
    assert idx.propose(b"a", [14, 15], 2) == (2, (16, 17))


def test_speculator_eligibility_and_suffix_publication() -> None:
    spec = Speculator("suffix", 3)
    done = _seq([1, 2, 3], [4, 5, 6, 7])
    spec.finished(done)  # published: prompt and output of its scope
    again = _seq([9, 1, 2], [3])
    assert spec.propose(again) == (4, 5, 6)
    assert spec.propose(_seq([9, 1, 2], [3], root=b"x" * 16)) == ()  # another tenant/salt
    assert spec.eligible(again)
    assert not spec.eligible(_seq([1], [2], speculative=False))  # opted out
    assert not spec.eligible(_seq([1], [2], max_tokens=2))  # one token left: nothing to draft
    constrained = _seq([1], [2])
    constrained.may_speculate = False
    assert not spec.eligible(constrained)
    assert not Speculator("off").eligible(again)
    assert spec.propose(_seq([9, 1, 2], [3], max_tokens=3)) == (4,)  # never past max_tokens
    with pytest.raises(ValueError, match="speculative must be one of"):
        check_mode("eagle", 4)
    with pytest.raises(ValueError, match="speculative_tokens"):
        check_mode("ngram", 0)


CHEAP_VERIFY = CostModel(0.010, 0.008, 0.001, "test: a draft costs a tenth of a step", 0.0, 0.001)
DEAR_VERIFY = CostModel(0.010, 0.001, 0.0005, "test: a draft costs most of a step", 0.0, 0.008)


def test_sizing_drafts_where_it_pays_and_stops_where_it_loses() -> None:
    good = Candidate(0.9, 6, 100)
    poor = Candidate(0.05, 6, 100)
    one = StepShape(1, 0, 101)
    assert size_drafts([good], one, 1, CHEAP_VERIFY, 64) == [6]
    assert size_drafts([poor], one, 1, CHEAP_VERIFY, 64) == [0]
    assert size_drafts([good], one, 1, DEAR_VERIFY, 64)[0] < 6
    # A large batch: each draft is priced against 64 rows' tokens, so none pays.
    big = StepShape(64, 0, 6400)
    assert size_drafts([good] * 64, big, 64, DEAR_VERIFY, 512) == [0] * 64
    assert size_drafts([good, good], one, 1, None, 5) == [5, 0]  # no cost model: budget only
    assert size_drafts([good], one, 1, CHEAP_VERIFY, 2) == [2]  # the token budget


def test_sizing_prices_drafts_by_the_draft_term_not_as_prefill() -> None:
    """A verify row stays a decode row plus its drafts: cheap prefill tokens do not make drafts
    look cheap (the old pricing turned the row into a prefill chunk, dropping its decode cost)."""
    good = Candidate(0.6, 4, 100)
    one = StepShape(1, 0, 101)
    cheap_prefill_dear_drafts = CostModel(0.010, 0.0001, 0.010, "test", 0.0, 0.012)
    assert size_drafts([good], one, 1, cheap_prefill_dear_drafts, 64) == [0]
    assert size_drafts([good], one, 1, replace(cheap_prefill_dear_drafts, draft_token_s=0.001),
                       64) == [4]


def test_speculation_turns_itself_off_once_the_step_cost_learns_drafts_lose() -> None:
    """A replica whose prior prices drafts cheaply drafts at first; verify steps that measure
    dear move the draft side of the online correction until sizing drafts nothing, while
    decode steps keep their price."""
    cost = StepCost(CostModel(0.010, 0.001, 0.001, "test prior", 0.0, 0.001), alpha=0.2)
    good = Candidate(0.7, 4, 100)
    one = StepShape(1, 0, 101)
    assert size_drafts([good], one, 1, cost, 64) == [4]
    true = CostModel(0.010, 0.001, 0.001, "test machine", 0.0, 0.012)
    for _ in range(60):
        verify = StepShape(1, 0, 105, 4)
        cost.observe(verify, true.predict_step_s(*verify))
        cost.observe(one, true.predict_step_s(*one))
    assert cost.draft_scale == pytest.approx(12, rel=0.1)
    assert cost.decode_scale == pytest.approx(1.0, rel=0.05)
    assert size_drafts([good], one, 1, cost, 64) == [0]


def test_sizing_prices_a_new_few_row_pass_as_a_weight_pass_and_stays_within_the_kernel() -> None:
    """On a decode-only step, drafts within the passes the decode rows open are priced by the
    draft term; one that opens another pass also costs a pass over the weights (a one-row
    step's price), and none takes the step past the kernel's row limit. A step with prefill is
    priced by the linear model alone."""
    rule = QueryRows(tile=4, limit=8)
    cost = CostModel(0.010, 0.001, 0.001, "test", 0.0, 0.001)  # a pass: 11 ms
    one = StepShape(1, 0, 101)
    assert size_drafts([Candidate(0.9, 4, 100)], one, 1, cost, 64, None) == [4]
    assert size_drafts([Candidate(0.9, 4, 100)], one, 1, cost, 64, rule) == [3]
    assert size_drafts([Candidate(0.9, 7, 100)], one, 1, cost, 64, rule) == [3]
    four = StepShape(4, 0, 404)
    rows_dear = CostModel(0.010, 0.001, 0.005, "test", 0.0, 0.001)  # a pass 15 ms of b4's 30
    assert size_drafts([Candidate(0.95, 6, 100)] * 4, four, 4, rows_dear, 64, rule) == [1] * 4
    assert size_drafts([Candidate(0.95, 6, 100)] * 4, four, 4, cost, 64, rule) == [0] * 4
    assert size_drafts([Candidate(0.5, 6, 100)] * 4, four, 4, rows_dear, 64, rule) == [0] * 4
    assert size_drafts([Candidate(0.5, 6, 100)] * 4, four, 4, rows_dear, 64, None) != [0] * 4
    assert size_drafts([Candidate(0.9, 6, 100)] * 8, StepShape(8, 0, 808), 8, cost, 64,
                       rule) == [0] * 8
    assert sum(size_drafts([Candidate(0.9, 6, 100)] * 8, StepShape(8, 64, 872), 8, cost, 64,
                           rule)) > 0
    assert [rule.extra_passes(1, d) for d in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, None]
    assert [rule.extra_passes(4, d) for d in range(6)] == [0, 1, 1, 1, 1, None]


def test_the_few_row_rule_matches_the_cpu_kernel() -> None:
    """The sizing rule's limit is the runner's (the rows past which a projection leaves the
    kernel), and so is its pass: the kernel runs every register tile over a weight panel held
    in L2, so its whole reach (a whole number of tiles) reads the weights once."""
    import re
    from pathlib import Path

    from kvfleet.worker.runner.models import linear

    gemv = (Path(linear.__file__).parents[1] / "gemv.c").read_text()
    assert CPU_FEW_ROWS.limit == linear.FEW_ROWS == CPU_FEW_ROWS.tile
    assert linear.FEW_ROWS % int(re.search(r"#define TILE_ROWS (\d+)", gemv).group(1)) == 0


def test_acceptance_follows_recent_verifications() -> None:
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(10):
        a.observe(4, 4)
    assert a.rate > 0.9
    for _ in range(10):
        a.observe(4, 0)
    assert a.rate < 0.2
    for _ in range(30):
        a.observe(0, 0)  # not drafting: back toward the prior
    assert 0.4 < a.rate < 0.6


def test_the_few_row_rule_is_the_cpu_runners_only() -> None:
    assert query_rows_for("cpu") is CPU_FEW_ROWS
    assert query_rows_for("cuda:0") is None
    assert query_rows_for("cuda") is None


def test_a_miss_at_the_first_draft_does_not_shorten_a_copying_rows_runs() -> None:
    """Copied text is accepted in runs: a row that copies whole drafts and sometimes misses at
    once keeps a high continuation (the per-token rate halves), and a run cut short counts one
    failed continuation, never the drafts past it."""
    a = Acceptance()
    assert a.continuation == 0.5
    for _ in range(10):
        a.observe(7, 7)
        a.observe(7, 0)
    assert a.continuation > 0.9
    assert a.rate < 0.6
    b = Acceptance()
    b.observe(7, 3)  # drafts 2 and 3 continued, draft 4 did not, 5..7 unseen
    assert (b.continued, b.followed) == (2, 3)
    b.observe(4, 0)
    assert (b.continued, b.followed) == (1.6, 2.4000000000000004)


def test_first_draft_chance_is_learnt_by_match_length() -> None:
    first = FirstByMatch(top=3)
    for _ in range(20):
        first.observe(1, 4, 0)
        first.observe(4, 4, 2)
    assert first.rate(1) < 0.1
    assert first.rate(3) > 0.9 and first.rate(7) == first.rate(3)  # longer matches share a class
    assert first.rate(2) == 0.5  # never verified: the prior
    for _ in range(100):
        first.observe(1, 0, 0)  # proposed, not drafted: back toward the prior
    assert 0.4 < first.rate(1) <= 0.5


def test_sizing_prices_the_first_draft_and_the_run_apart() -> None:
    """Gains ``f · c^(j-1)``: a likely first draft and long runs earn the whole proposal where
    the per-token model (``a^j``) stopped early; an unlikely first draft earns none."""
    one = StepShape(1, 0, 101)
    assert size_drafts([Candidate(0.95, 7, 100, first=0.6)], one, 1, CHEAP_VERIFY, 64) == [7]
    assert size_drafts([Candidate(0.6, 7, 100)], one, 1, CHEAP_VERIFY, 64) == [3]
    assert size_drafts([Candidate(0.95, 7, 100, first=0.02)], one, 1, CHEAP_VERIFY, 64) == [0]
    assert size_drafts([Candidate(0.9, 6, 100, first=0.9)], one, 1, CHEAP_VERIFY, 64) == \
        size_drafts([Candidate(0.9, 6, 100)], one, 1, CHEAP_VERIFY, 64)


class FakeClock:
    """A step timer: each step advances it by the machine's seconds for the shape × the host's
    slowdown, plus a stall (another process holding the core)."""

    def __init__(self, machine: CostModel) -> None:
        self.machine, self.now = machine, 0.0

    def step(self, shape: StepShape, slowdown: float = 1.0, stall_s: float = 0.0) -> float:
        start = self.now
        self.now += self.machine.predict_step_s(*shape) * slowdown + stall_s
        return self.now - start


def _b1_steps(n: int):
    """A batch-1 replica's steps: one decode row at a growing context, 0..7 drafts."""
    for i in range(n):
        drafts = (0, 7, 3, 7, 2, 0, 7, 5)[i % 8]
        yield StepShape(1, 0, 400 + i + drafts, drafts)


def test_the_draft_price_is_the_slope_in_drafts_whatever_slows_every_step() -> None:
    """The draft side is fitted as the marginal seconds of a draft across verify steps of
    different draft counts, beside the decode side: with a prior far dearer than the machine
    (its decode side held at the correction's bound), a host that slows every step, or one that
    adds a stall to each, a draft's price relative to a decode step is the machine's (with the
    stall, the stalled step's), and sizing stays where it was under load."""
    prior = CostModel(0.32, 0.0125, 0.088, "far-off prior")  # no draft term: a prefill token
    machine = CostModel(0.014, 0.001, 0.002, "machine", 0.0, 0.0012)
    cost, clock = StepCost(prior), FakeClock(machine)

    def relative_price() -> float:  # a draft ÷ a one-row decode step without context
        return cost.prior.draft_token_s * cost.draft_scale / cost.predict_step_s(1, 0, 0)

    want = machine.draft_token_s / machine.predict_step_s(1, 0, 0)
    for shape in _b1_steps(300):  # quiet
        cost.observe(shape, clock.step(shape))
    assert cost.decode_scale == pytest.approx(1 / 16)  # the decode side sits at its bound
    assert relative_price() == pytest.approx(want, rel=0.05)
    cands = [Candidate(0.7, 7, 400, first=0.9)]
    quiet = size_drafts(cands, StepShape(1, 0, 401), 1, cost, 64)
    before = relative_price()
    cost.observe(StepShape(1, 0, 700, 7), clock.step(StepShape(1, 0, 700, 7), slowdown=50))
    assert relative_price() == pytest.approx(before)  # a pause does not enter the fit
    for shape in _b1_steps(300):  # loaded: every step 2.5× as long
        cost.observe(shape, clock.step(shape, slowdown=2.5))
    assert cost.decode_scale > 1 / 16  # off its bound: the decode side follows the load
    assert relative_price() == pytest.approx(want, rel=0.05)
    assert size_drafts(cands, StepShape(1, 0, 401), 1, cost, 64) == quiet
    for shape in _b1_steps(300):  # a stall of half a step in each
        cost.observe(shape, clock.step(shape, stall_s=0.008))
    stalled = machine.draft_token_s / (machine.predict_step_s(1, 0, 0) + 0.008)  # a step's share
    assert relative_price() == pytest.approx(stalled, rel=0.05)
    # a draft is now a smaller share of a step: as many drafts or more pay
    assert size_drafts(cands, StepShape(1, 0, 401), 1, cost, 64)[0] >= quiet[0]


def test_steps_that_all_carry_the_same_drafts_leave_the_draft_side_to_the_share_out() -> None:
    """With no spread in draft counts the slope cannot be told from the step's own cost: the
    draft side moves by its share of each step's error, as before there was a fit."""
    cost = StepCost(CostModel(0.010, 0.001, 0.001, "prior", 0.0, 0.001), alpha=0.2)
    clock = FakeClock(CostModel(0.010, 0.001, 0.001, "machine", 0.0, 0.002))
    shape = StepShape(1, 0, 105, 4)
    for _ in range(100):
        cost.observe(shape, clock.step(shape))
    assert cost.predict_step_s(*shape) == pytest.approx(clock.machine.predict_step_s(*shape), rel=0.01)
    assert 1.0 < cost.draft_scale < 2.0 and cost.decode_scale > 1.0  # the error shared out
