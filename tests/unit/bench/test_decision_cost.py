"""``bench.cluster.decision_cost``: the stream it routes and the shape of what it reports (never timed)."""

from __future__ import annotations

import pytest

from bench.cluster.decision_cost import SUFFIX_BLOCKS, chains, decision_cost
from kvfleet.router.policy import make_policy


def test_a_family_shares_its_prefix_and_each_request_has_its_own_blocks():
    stream = chains(10, families=2, count=20, seed=0)
    assert all(len(c) == 10 for _, c in stream)
    by_family = {}
    for f, c in stream:
        by_family.setdefault(f, []).append(c)
    for cs in by_family.values():
        assert all(c[:10 - SUFFIX_BLOCKS] == cs[0][:10 - SUFFIX_BLOCKS] for c in cs)
    assert len({c[-1] for _, c in stream}) == 20
    assert stream[0][1][0] != [c for f, c in stream if f != stream[0][0]][0][0]
    with pytest.raises(ValueError, match="blocks"):
        chains(SUFFIX_BLOCKS, 1, 1, 0)


def test_it_reports_every_policy_per_prompt_size_against_the_first():
    out = decision_cost({"prefix_aware": lambda: make_policy("prefix_aware"),
                         "predicted_ttft": lambda: make_policy("predicted_ttft")},
                        [8, 40], replicas=4, families=3, decisions=30, rounds=2)
    assert set(out) == {8, 40}
    for r in out.values():
        assert r["prefix_aware"]["vs_first"] == 1.0
        assert r["predicted_ttft"]["us"] > 0
