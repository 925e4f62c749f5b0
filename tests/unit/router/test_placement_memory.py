"""``PlacementMemory``: the blocks a router sent where, before the index shows them, and each
replica's working set (pure bookkeeping over decision numbers)."""

from __future__ import annotations

import pytest

from kvfleet.router.placement_memory import PlacementMemory


def chain(name: bytes, n: int) -> list[bytes]:
    return [name + b"-%d" % i for i in range(n)]


def test_matched_is_the_leading_run_sent_to_that_replica_within_the_horizon():
    m = PlacementMemory(horizon=4, window=16)
    m.record(chain(b"p", 10), "a", decision=1)
    assert m.matched(chain(b"p", 10), "a", decision=2) == 10
    assert m.matched(chain(b"p", 6) + [b"other"], "a", decision=2) == 6  # the shared prefix
    assert m.matched(chain(b"p", 10), "b", decision=2) == 0
    assert m.matched([b"q-0"], "a", decision=2) == 0
    assert m.matched(chain(b"p", 10), "a", decision=5) == 10  # 4 decisions later: still
    assert m.matched(chain(b"p", 10), "a", decision=6) == 0   # past the horizon
    # A longer chain sent later extends the run; the earlier blocks are refreshed with it.
    m.record(chain(b"p", 12), "a", decision=6)
    assert m.matched(chain(b"p", 12), "a", decision=7) == 12


def test_the_working_set_counts_distinct_blocks_and_forgets_past_the_window():
    m = PlacementMemory(horizon=2, window=8)
    m.record(chain(b"p", 10), "a", 1)
    m.record(chain(b"p", 10), "a", 2)  # the same blocks again: not counted twice
    m.record(chain(b"p", 4) + [b"x"], "a", 3)
    m.record(chain(b"q", 3), "b", 3)
    assert (m.working_set("a"), m.working_set("b"), m.working_set("c")) == (11, 3, 0)
    m.record([b"y"], "b", 12)  # prunes what was last sent before decision 4
    assert (m.working_set("a"), m.working_set("b")) == (0, 1)


def test_the_horizon_must_fit_the_window():
    with pytest.raises(ValueError, match="horizon"):
        PlacementMemory(horizon=0, window=8)
    with pytest.raises(ValueError, match="horizon"):
        PlacementMemory(horizon=9, window=8)
