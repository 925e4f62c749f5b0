"""What this router sent where, recently: blocks the prefix index may not show yet, and each
replica's KV working set.

1. **Index lag.** A replica publishes a block once its prefill has computed it (one engine step
   after the chunk runs, behind whatever queue it has), so for a second or more after a request
   is sent its prefix is in no index. A second request of the same prefix in that window sees no
   holder and is placed as a new family: two replicas compute the prefix, hold it, and split
   its traffic. ``matched_by`` counts the blocks sent within ``horizon`` decisions as held.
   (SGLang's cache-aware router keeps a whole approximate tree of what it sent where; here the
   index stays the truth once it has caught up.)
2. **Working set.** ``working_set`` is the number of distinct blocks sent to a replica within
   the last ``window`` decisions: the KV its traffic needs resident to hit. A replica whose
   working set exceeds its KV evicts blocks its own traffic comes back for (a thrash), so a new
   prefix belongs where the working set has the most room — not where the load happens to be
   lowest at the moment it first arrives.

**Cost.** Chained hashes make what was sent prefix-closed (a block implies its whole prefix),
so the record is a radix tree: a node is a *run* of blocks every recorded chain either passes
through whole or not at all, with the last decision each replica was sent a chain through it.
A decision walks and stamps the runs its chain passes (a few: template, family prefix, the
request's own suffix; each matched by bisection, the chain property again) and adds at most
one run (a list slice), so it costs O(runs × log blocks), not a dict write per block (the
per-block record's cost grew with the prompt: docs/routing.md, "The record's cost").
Every block of a run was sent to the same replicas at the same decisions, so per-block answers
(``matched_by``, ``working_set``) are exactly those of a ``block → {replica: decision}`` map.
"""

from __future__ import annotations

from typing import Optional, Sequence


class _Run:
    """Blocks ``blocks`` (chained: ``blocks[0]`` extends the parent's last) under ``parent``;
    ``sent``: replica → the last decision a chain through this run was sent there (a parent's
    is never older than its children's: every chain through a child passes the parent)."""

    __slots__ = ("blocks", "parent", "children", "sent")

    def __init__(self, blocks: list[bytes], parent: Optional[_Run], sent: dict[str, int]) -> None:
        self.blocks = blocks
        self.parent = parent
        self.children: dict[bytes, _Run] = {}  # keyed by the child's first block
        self.sent = sent


class PlacementMemory:
    """Which leading blocks of a chain were sent to which replica, over the last ``window``
    decisions (``horizon`` of them count for ``matched_by``)."""

    def __init__(self, horizon: int, window: int) -> None:
        if not 1 <= horizon <= window:
            raise ValueError(f"need 1 <= horizon <= window, got {horizon}, {window}")
        self.horizon, self.window = horizon, window
        self._root = _Run([], None, {})
        self._held: dict[str, int] = {}  # replica → blocks of the runs stamped with it
        self._pruned_at = 0

    def record(self, chain: Sequence[bytes], replica_id: str, decision: int) -> None:
        """Note that ``chain``'s blocks were sent to ``replica_id`` at ``decision`` (a
        non-decreasing counter); forgets what was last sent before ``window`` decisions ago
        every ``window // 8`` decisions."""
        node, depth = self._root, 0
        for run, end in self._walk(chain):
            if end - depth < len(run.blocks):  # the chain leaves (or ends) inside this run
                run = self._split(run, end - depth)
            self._stamp(run, replica_id, decision)
            node, depth = run, end
        if depth < len(chain):
            leaf = _Run(list(chain[depth:]), node, {})
            node.children[leaf.blocks[0]] = leaf
            self._stamp(leaf, replica_id, decision)
        if decision - self._pruned_at >= max(1, self.window // 8):
            self._prune(decision - self.window)
            self._pruned_at = decision

    def matched_by(self, chain: Sequence[bytes], decision: int) -> dict[str, int]:
        """Replica → leading blocks of ``chain`` sent to it in the ``horizon`` decisions before
        ``decision`` (replicas with none are absent). One walk for every replica."""
        found: dict[str, int] = {}
        for run, end in self._walk(chain):
            for rid, at in run.sent.items():
                if decision - at <= self.horizon:
                    found[rid] = end  # runs come in chain order: the deepest stamp wins
        return found

    def matched(self, chain: Sequence[bytes], replica_id: str, decision: int) -> int:
        """Leading blocks of ``chain`` sent to ``replica_id`` in the ``horizon`` decisions
        before ``decision`` (0 if none)."""
        return self.matched_by(chain, decision).get(replica_id, 0)

    def working_set(self, replica_id: str) -> int:
        """Distinct blocks sent to ``replica_id`` within about the last ``window`` decisions
        (entries up to ``window // 8`` decisions older linger until the next prune)."""
        return self._held.get(replica_id, 0)

    def check_invariants(self) -> None:
        """Every replica's working set is the blocks of the runs stamped with it, no run is
        empty, and a run is never stamped later than its parent (AssertionError if not)."""
        held: dict[str, int] = {}
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.blocks and child.blocks[0] == key and child.parent is node
                for rid, at in child.sent.items():
                    assert node is self._root or node.sent.get(rid, -1) >= at, "child newer"
                    held[rid] = held.get(rid, 0) + len(child.blocks)
                stack.append(child)
        assert held == {r: n for r, n in self._held.items() if n}, (held, self._held)

    def _walk(self, chain: Sequence[bytes]) -> list[tuple[_Run, int]]:
        """The runs ``chain`` enters, in order, each with the chain depth where its match
        ends (the last may be matched only in part)."""
        path: list[tuple[_Run, int]] = []
        node, depth = self._root, 0
        while depth < len(chain):
            run = node.children.get(chain[depth])
            if run is None:
                break
            # Leading blocks of run equal to chain[depth:]: equality is prefix-closed, bisect.
            lo, hi = 1, min(len(run.blocks), len(chain) - depth)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if run.blocks[mid - 1] == chain[depth + mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            depth += lo
            path.append((run, depth))
            if lo < len(run.blocks):
                break
            node = run
        return path

    def _split(self, run: _Run, n: int) -> _Run:
        """Cut ``run`` after its first ``n`` blocks; returns the head (the tail keeps the
        children; both keep the stamps, so working sets do not change)."""
        head = _Run(run.blocks[:n], run.parent, dict(run.sent))
        assert run.parent is not None
        run.parent.children[head.blocks[0]] = head
        run.blocks, run.parent = run.blocks[n:], head
        head.children[run.blocks[0]] = run
        return head

    def _stamp(self, run: _Run, replica_id: str, decision: int) -> None:
        if replica_id not in run.sent:
            self._held[replica_id] = self._held.get(replica_id, 0) + len(run.blocks)
        run.sent[replica_id] = decision

    def _prune(self, oldest: int) -> None:
        """Drop stamps older than ``oldest``, and runs left with none (their descendants,
        never stamped later, lose theirs in the same pass)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                for rid in [r for r, at in child.sent.items() if at < oldest]:
                    del child.sent[rid]
                    self._held[rid] -= len(child.blocks)
                if not child.sent:
                    del node.children[key]
                stack.append(child)  # an unlinked run's descendants still leave the counts
