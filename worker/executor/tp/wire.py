"""What rank 0 sends ranks 1..T-1, as flat little-endian int64 arrays: a fixed schema.

Nothing in a message is code or an object graph: a rank reads integers and checks every count
against the message's length (a malformed message raises ``ValueError``), so a process that
joins the group's store can at worst send garbage, never run anything on decode.

A call (:func:`encode_call`) is ``[method, nargs, len_0 .. len_{nargs-1}, arg_0, …]`` where
``method`` indexes :data:`METHODS` (what a rank runs for it: see
:class:`~kvfleet.worker.executor.tp.rank_worker.RankWorker`).

A step plan travels as a diff against the previous plan. :class:`PlanEncoder` (rank 0) and
each rank's :class:`PlanDecoder` both hold the block tables of the sequences of the last plan,
by a small integer key. A sequence new to the plan is sent with its whole table once; after
that each chunk carries how many leading blocks of its last table it keeps (all of them while
it decodes) and the blocks appended after those; a sequence absent from a plan is forgotten
(freed, preempted or not scheduled: it is sent whole if it comes back). Layout::

    [n_chunks, n_copies, n_commits,
     n_chunks × (key, num_computed_tokens, adapter_slot, n_tokens, keep, n_tail, n_groups,
                 num_draft_tokens, token_ids × n_tokens, tail × n_tail,
                 n_groups × (n_entries, entries × n_entries)),
     n_copies × (src_block, dst_block),
     n_commits × (slot, prepared)]

A chunk's speculative drafts (``num_draft_tokens``) travel with it: ranks other than 0 compute
no logits, but on CPU a verify chunk's rows attend through the decode kernel (see
:mod:`kvfleet.worker.runner.attention`), and every rank must take the same path.

``n_groups`` block tables of layer groups 1.. follow each chunk whole (0 for one group).
``n_commits`` adapter slot changes to make before the forward: ``prepared`` > 0 installs the
adapter a rank prepared under that id (off the step path); 0 empties the slot.

A ``pausable_step`` carries a plan as ``step`` does, and its forward may pause between
layers (layer-level yield): after each layer but the last, rank 0 broadcasts one flag
(:meth:`~.comm.RankComm.send_flag`); "pause" makes every rank hold the forward and serve
calls (the nested step's ``transfer`` and ``step``) until ``resume`` (no arguments)
continues it, flags again after each layer.

Host-tier block moves (``transfer``, before a step's forward) travel as two arguments, the
saves and the restores, each ``n × (block, hash[0:8], hash[8:16])`` (:func:`encode_moves`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from kvfleet.allocator.kv_cache_manager import group_key, split_group_key
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan

# What rank 0 may call on the other ranks, by index.
METHODS = ("step", "barrier", "stop", "transfer", "pausable_step", "resume")
_CHUNK_HEAD = 8
Commit = tuple[int, int]  # (slot, prepared id; 0 = empty the slot)
_GROUP_SHIFT = 40  # a block move's layer group sits above this bit of its block word


def encode_call(method: str, *args: np.ndarray) -> np.ndarray:
    """One call of ``method`` (one of :data:`METHODS`) with int64 array ``args``.

    Raises:
        ValueError: an unknown method.
    """
    if method not in METHODS:
        raise ValueError(f"unknown rank method {method!r}; known: {METHODS}")
    head = [METHODS.index(method), len(args), *(len(a) for a in args)]
    parts = [np.asarray(head, dtype="<i8"), *(np.asarray(a, dtype="<i8") for a in args)]
    return np.concatenate(parts)


def decode_call(msg: np.ndarray) -> tuple[str, list[np.ndarray]]:
    """``(method, args)`` of a message from :func:`encode_call`.

    Raises:
        ValueError: an unknown method or counts that do not match the message's length.
    """
    if msg.ndim != 1 or len(msg) < 2:
        raise ValueError(f"malformed rank call: {msg.shape}")
    method, nargs = int(msg[0]), int(msg[1])
    if not 0 <= method < len(METHODS) or not 0 <= nargs <= len(msg) - 2:
        raise ValueError(f"malformed rank call: method {method}, {nargs} args")
    lens = msg[2: 2 + nargs].tolist()
    if min(lens, default=0) < 0 or 2 + nargs + sum(lens) != len(msg):
        raise ValueError(f"malformed rank call: argument lengths {lens} for {len(msg)} ints")
    args, at = [], 2 + nargs
    for n in lens:
        args.append(msg[at: at + n])
        at += n
    return METHODS[method], args


def encode_moves(moves: Sequence[tuple[int, bytes]]) -> np.ndarray:
    """``(block, key)`` pairs as int64 triples: the key's 16-byte chain hash as two words, its
    layer group (:func:`~kvfleet.allocator.kv_cache_manager.group_key`; 0 for a plain chain
    hash) above bit :data:`_GROUP_SHIFT` of the block's word.

    Raises:
        ValueError: a chain hash that is not 16 bytes, or a block id past the group bits.
    """
    out = np.empty((len(moves), 3), dtype="<i8")
    for i, (block, key) in enumerate(moves):
        group, h = split_group_key(key)
        if len(h) != 16:
            raise ValueError(f"block hash of {len(h)} bytes, want 16")
        if not 0 <= block < 1 << _GROUP_SHIFT:
            raise ValueError(f"block id {block} outside 0..2**{_GROUP_SHIFT}")
        out[i, 0] = block | (group << _GROUP_SHIFT)
        out[i, 1:] = np.frombuffer(h, dtype="<i8")
    return out.reshape(-1)


def decode_moves(arr: np.ndarray) -> list[tuple[int, bytes]]:
    """The pairs of :func:`encode_moves`.

    Raises:
        ValueError: a length that is not a multiple of 3.
    """
    if len(arr) % 3:
        raise ValueError(f"malformed block moves: {len(arr)} ints")
    rows = np.asarray(arr, dtype="<i8").reshape(-1, 3)
    mask = (1 << _GROUP_SHIFT) - 1
    return [(int(r[0]) & mask, group_key(int(r[0]) >> _GROUP_SHIFT, r[1:].tobytes()))
            for r in rows]


def _kept(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """Length of the common prefix of two block tables."""
    if len(old) <= len(new) and new[: len(old)] == old:
        return len(old)  # the usual case: blocks only appended
    differs = (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
    return next(differs, min(len(old), len(new)))


class PlanEncoder:
    """Rank 0's side of the plan diff: encodes each plan against the one before it."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, tuple[int, ...]]] = {}  # seq id -> (key, table sent)
        self._keys = itertools.count(1)

    def encode(self, plan: StepPlan, commits: Sequence[Commit] = ()) -> np.ndarray:
        """``plan`` (and adapter slot ``commits``) as an int64 message; every rank must decode
        every message this encoder produced, in order."""
        out = [len(plan.chunks), len(plan.block_copies), len(commits)]
        known: dict[str, tuple[int, tuple[int, ...]]] = {}
        for c in plan.chunks:
            key, old = self._known.get(c.seq_id) or (next(self._keys), ())
            keep = _kept(old, c.block_table)
            tail = c.block_table[keep:]
            out += (key, c.num_computed_tokens, c.adapter_slot, len(c.token_ids), keep, len(tail),
                    len(c.group_tables), c.num_draft_tokens)
            out += c.token_ids
            out += tail
            # Other layer groups' tables travel whole (their heads turn into holes as a
            # sliding window moves, so a diff would rarely keep much).
            for t in c.group_tables:
                out.append(len(t))
                out += t
            known[c.seq_id] = (key, c.block_table)
        for src, dst in plan.block_copies:
            out += (src, dst)
        for slot, prepared in commits:
            out += (slot, prepared)
        self._known = known
        return np.asarray(out, dtype="<i8")


class _Reader:
    def __init__(self, values: list[int]) -> None:
        self.values, self.at = values, 0

    def take(self, n: int) -> list[int]:
        if n < 0 or self.at + n > len(self.values):
            raise ValueError(f"malformed step plan: {n} ints wanted at {self.at} of "
                             f"{len(self.values)}")
        self.at += n
        return self.values[self.at - n: self.at]


class PlanDecoder:
    """A rank's side of the plan diff: rebuilds each plan from its message (sequence ids
    become the encoder's keys, as strings)."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[int, ...]] = {}

    def decode(self, msg: np.ndarray) -> tuple[StepPlan, list[Commit]]:
        """The plan and adapter slot commits of one :meth:`PlanEncoder.encode` message.

        Raises:
            ValueError: a malformed message (counts that do not fit, a repeated sequence,
                more kept blocks than the sequence had); this decoder's state is unchanged.
        """
        r = _Reader(msg.tolist())
        n_chunks, n_copies, n_commits = r.take(3)
        chunks, tables = [], {}
        for _ in range(n_chunks):
            key, computed, slot, n_tokens, keep, n_tail, n_groups, drafts = r.take(_CHUNK_HEAD)
            tokens, tail = r.take(n_tokens), r.take(n_tail)
            old = self._tables.get(key, ())
            if not 0 <= drafts < max(1, n_tokens):
                raise ValueError(f"malformed step plan: {drafts} drafts in a chunk of {n_tokens} tokens")
            if key in tables or not 0 <= keep <= len(old):
                raise ValueError(f"malformed step plan: sequence {key} keeps {keep} of "
                                 f"{len(old)} blocks")
            table = (old if keep == len(old) else old[:keep]) + tuple(tail)
            tables[key] = table
            groups = tuple(tuple(r.take(r.take(1)[0])) for _ in range(n_groups))
            chunks.append(SeqChunk(str(key), tuple(tokens), computed, table, slot, drafts, groups))
        pairs = r.take(2 * n_copies)
        copies = tuple(zip(pairs[::2], pairs[1::2], strict=True))
        pairs = r.take(2 * n_commits)
        commits = list(zip(pairs[::2], pairs[1::2], strict=True))
        if r.at != len(r.values):
            raise ValueError(f"malformed step plan: {len(r.values) - r.at} trailing ints")
        self._tables = tables
        return StepPlan(tuple(chunks), copies), commits
