"""``PlacementMemory``: the blocks a router sent where, before the index shows them, and each
replica's working set (pure bookkeeping over decision numbers)."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvfleet.router.placement_memory import PlacementMemory
from tests.unit.router import factories

chain = factories.chain


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


class PerBlockRecord:
    """The record as a ``block → {replica: decision}`` map (the definition the radix tree must
    answer exactly), pruned at the same decisions."""

    def __init__(self, horizon: int, window: int) -> None:
        self.horizon, self.window = horizon, window
        self.sent: dict[bytes, dict[str, int]] = {}
        self.pruned_at = 0

    def record(self, chain: list[bytes], rid: str, decision: int) -> None:
        for h in chain:
            self.sent.setdefault(h, {})[rid] = decision
        if decision - self.pruned_at >= max(1, self.window // 8):
            oldest = decision - self.window
            self.sent = {h: kept for h, by in self.sent.items()
                         if (kept := {r: d for r, d in by.items() if d >= oldest})}
            self.pruned_at = decision

    def matched(self, chain: list[bytes], rid: str, decision: int) -> int:
        n = 0
        while n < len(chain) and decision - self.sent.get(chain[n], {}).get(rid, -10**9) <= self.horizon:
            n += 1
        return n

    def working_set(self, rid: str) -> int:
        return sum(rid in by for by in self.sent.values())


def chained(parent: bytes, tokens: list[int]) -> list[bytes]:
    """Block hashes chained as the router's are: each one names its whole prefix."""
    out = []
    for t in tokens:
        parent = hashlib.sha256(parent + b"%d" % t).digest()[:16]
        out.append(parent)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_radix_record_answers_exactly_as_a_per_block_map(seed):
    # Families (a shared prefix), turns extending a conversation, prompts that are a strict
    # prefix of earlier ones, a few replicas, and a window short enough to prune often.
    rng = random.Random(seed)
    horizon, window = rng.choice([(2, 8), (4, 16), (16, 64)])
    memory, model = PlacementMemory(horizon, window), PerBlockRecord(horizon, window)
    families = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    conversations: list[list[int]] = []
    for decision in range(1, 400):
        kind = rng.random()
        if kind < 0.3 and conversations:
            tokens = rng.choice(conversations)
            tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        elif kind < 0.4 and conversations:
            tokens = rng.choice(conversations)[:rng.randrange(1, 30)]
        else:
            tokens = rng.choice(families) + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
            conversations.append(list(tokens))
        chain = chained(b"root", tokens)
        probe = chained(b"root", rng.choice(families) + [rng.randrange(50)])
        for c in (chain, probe):
            by = memory.matched_by(c, decision)
            for rid in "abcd":
                assert by.get(rid, 0) == model.matched(c, rid, decision)
        rid = rng.choice("abcd")
        memory.record(chain, rid, decision)
        model.record(chain, rid, decision)
        memory.check_invariants()
        assert [memory.working_set(r) for r in "abcd"] == [model.working_set(r) for r in "abcd"]


def test_a_decision_adds_at_most_one_run_and_forgets_unlinked_runs_blocks():
    m = PlacementMemory(horizon=2, window=8)
    m.record(chain(b"p", 2048), "a", 1)
    m.record(chain(b"p", 2040) + [b"u1"], "a", 2)  # splits the run once, adds one
    m.record(chain(b"p", 2040) + [b"u2"], "b", 3)
    assert len(m._root.children) == 1
    head = m._root.children[b"p-0"]
    assert len(head.blocks) == 2040 and len(head.children) == 3
    assert (m.working_set("a"), m.working_set("b")) == (2049, 2041)
    m.check_invariants()
    m.record([b"y"], "b", 12)  # everything above was last sent before decision 4
    m.check_invariants()
    assert (m.working_set("a"), m.working_set("b")) == (0, 1)
    assert list(m._root.children) == [b"y"]


def test_the_horizon_must_fit_the_window():
    with pytest.raises(ValueError, match="horizon"):
        PlacementMemory(horizon=0, window=8)
    with pytest.raises(ValueError, match="horizon"):
        PlacementMemory(horizon=9, window=8)
