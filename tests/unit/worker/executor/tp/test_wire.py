"""The rank group's fixed-schema messages: calls, and step plans sent as diffs."""

from __future__ import annotations

import numpy as np
import pytest

from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.executor.tp.wire import PlanDecoder, PlanEncoder, decode_call, encode_call


def _same(got: StepPlan, want: StepPlan) -> None:
    """Equal but for sequence ids (a rank sees the encoder's keys)."""
    assert [(c.token_ids, c.num_computed_tokens, c.tables(), c.adapter_slot, c.num_draft_tokens)
            for c in got.chunks] \
        == [(c.token_ids, c.num_computed_tokens, c.tables(), c.adapter_slot, c.num_draft_tokens)
            for c in want.chunks]
    assert got.block_copies == want.block_copies


def test_plans_round_trip_through_appends_copy_on_write_leaving_and_returning() -> None:
    enc, dec = PlanEncoder(), PlanDecoder()
    plans = [
        StepPlan((SeqChunk("a#0", (1, 2, 3, 4, 5), 0, (7, 3)), SeqChunk("b#0", (9,), 0, (4,), 2))),
        StepPlan((SeqChunk("a#0", (6,), 5, (7, 3)), SeqChunk("b#0", (8,), 1, (4,), 2))),
        # a appends a block; b's last block is copied (copy-on-write) into 11
        StepPlan((SeqChunk("a#0", (6,), 6, (7, 3, 5)), SeqChunk("b#0", (8,), 2, (11,), 2)),
                 block_copies=((4, 11),)),
        StepPlan((SeqChunk("b#0", (1, 4, 4), 3, (11,), 2, 2),)),  # a not scheduled; b verifies 2 drafts
        StepPlan((SeqChunk("a#0", (6,), 0, (2, 8)),)),    # a back (recompute), new table
    ]
    sizes = []
    for i, plan in enumerate(plans):
        msg = enc.encode(plan, commits=[(1, i)] if i == 2 else ())
        sizes.append(len(msg))
        got, commits = dec.decode(msg)
        _same(got, plan)
        assert commits == ([(1, 2)] if i == 2 else [])
    # a decode step of a known sequence carries no blocks: its 8-int head and one token
    assert sizes[1] == 3 + 2 * (8 + 1)


def test_layer_group_tables_travel_whole_holes_included() -> None:
    enc, dec = PlanEncoder(), PlanDecoder()
    plans = [
        StepPlan((SeqChunk("a#0", (1, 2, 3), 0, (7,), group_tables=((3,), (9,))),)),
        StepPlan((SeqChunk("a#0", (4, 5), 3, (7, 8), group_tables=((3, 4), (9, 2))),)),
        # the sliding groups released their first block: a hole (-1) heads their tables
        StepPlan((SeqChunk("a#0", (6,), 5, (7, 8), group_tables=((-1, 4), (-1, 2))),)),
    ]
    for plan in plans:
        got, _ = dec.decode(enc.encode(plan))
        _same(got, plan)


def test_a_sequence_seen_again_keeps_its_key_and_sends_only_appended_blocks() -> None:
    enc, dec = PlanEncoder(), PlanDecoder()
    table = tuple(range(100, 400))
    first = enc.encode(StepPlan((SeqChunk("s", (1,), 0, table),)))
    dec.decode(first)
    again = enc.encode(StepPlan((SeqChunk("s", (2,), 1, table + (401,)),)))
    got, _ = dec.decode(again)
    assert got.chunks[0].block_table == table + (401,)
    assert len(again) == 3 + 8 + 1 + 1 < len(first)


@pytest.mark.parametrize("msg", [
    [],                                  # no header
    [1, 0, 0],                           # a chunk announced, none sent
    [1, 0, 0, 5, 0, 0, 1, 0, 0, 0, 0],   # a chunk without its token
    [1, 0, 0, 5, 0, 0, 1, 3, 0, 0, 0, 9],  # keeps 3 blocks of a sequence never sent
    [0, 0, 0, 1],                        # trailing ints
    [0, 1, 0, 4],                        # half a block copy
    [2, 0, 0, 5, 0, 0, 1, 0, 0, 0, 0, 9, 5, 0, 0, 1, 0, 0, 0, 0, 9],  # one sequence twice
    [1, 0, 0, 5, 0, 0, -1, 0, 0, 0, 0],  # a negative count
    [1, 0, 0, 5, 0, 0, 1, 0, 0, 1, 0, 9],  # a group table announced, not sent
    [1, 0, 0, 5, 0, 0, 1, 0, 0, 0, 1, 9],  # a draft in a one-token chunk
    [1, 0, 0, 5, 0, 0, 2, 0, 0, 0, -1, 9, 9],  # a negative draft count
])
def test_malformed_plans_are_refused_and_leave_the_decoder_as_it_was(msg) -> None:
    dec = PlanDecoder()
    dec.decode(PlanEncoder().encode(StepPlan((SeqChunk("s", (1,), 0, (3,)),))))
    with pytest.raises(ValueError, match="malformed step plan"):
        dec.decode(np.asarray(msg, dtype=np.int64))
    ok, _ = dec.decode(np.asarray([1, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 2], dtype=np.int64))
    assert ok.chunks[0].block_table == (3,)  # the kept block survived the refusals


def test_calls_round_trip_and_only_known_methods_pass() -> None:
    method, args = decode_call(encode_call("step", np.arange(4), np.array([9])))
    assert method == "step" and [a.tolist() for a in args] == [[0, 1, 2, 3], [9]]
    assert decode_call(encode_call("barrier")) == ("barrier", [])
    with pytest.raises(ValueError, match="unknown rank method"):
        encode_call("__reduce__")
    for bad in ([99, 0], [0, 1, 5, 1], [0, 2, 1], [0]):
        with pytest.raises(ValueError, match="malformed rank call"):
            decode_call(np.asarray(bad, dtype=np.int64))
