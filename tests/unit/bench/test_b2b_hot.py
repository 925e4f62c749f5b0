"""``b2b_requests``' hot customer: the share of group 0, and the uniform stream unchanged."""

from __future__ import annotations

from bench.common.workload import B2BWorkload, b2b_requests

W = B2BWorkload(groups=6, users_per_group=1, system_tokens=32, user_tokens=16,
                question_tokens=8)


def test_hot_share_sends_that_share_to_group_0() -> None:
    uniform = b2b_requests(W, [(1.0, 600)], seed=3)
    assert b2b_requests(W, [(1.0, 600)], seed=3, hot_share=0.0) == uniform
    hot = b2b_requests(W, [(1.0, 600)], seed=3, hot_share=0.7)
    share = sum(r.group == 0 for r in hot) / len(hot)
    assert 0.7 < share < 0.82  # 0.7 + 0.3 / 6 expected
    assert sum(r.group == 0 for r in uniform) / len(uniform) < 0.25
    # A group's requests share its system prompt whatever the draw.
    assert {r.token_ids[:32] for r in hot if r.group == 0} == \
        {r.token_ids[:32] for r in uniform if r.group == 0}
