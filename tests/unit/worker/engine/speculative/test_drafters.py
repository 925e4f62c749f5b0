"""The draft-free drafters and the sizing rule, without a model."""

from __future__ import annotations

import pytest

from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.engine.speculative.ngram import NgramIndex
from kvfleet.worker.engine.speculative.sizing import Acceptance, Candidate, size_drafts
from kvfleet.worker.engine.speculative.speculator import Speculator, check_mode
from kvfleet.worker.engine.speculative.suffix import SuffixIndex
from kvfleet.worker.step_cost.model import CostModel, StepShape


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


CHEAP_VERIFY = CostModel(0.010, 0.001, 0.001, "test: a verify token costs a tenth of a step")
DEAR_VERIFY = CostModel(0.010, 0.008, 0.0005, "test: a verify token costs most of a step")


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
