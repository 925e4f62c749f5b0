"""An engine output's last message on the wire: usage and the worker's timing, replica-seconds
included, as the client reads them (the router relays the worker's messages unchanged)."""

from __future__ import annotations

import pytest

from kvfleet.client import Chunk
from kvfleet.worker.engine.output.outputs import SeqOutput, Timing, Usage
from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.service.server import output_to_proto


def test_the_last_message_carries_the_workers_timing_and_replica_seconds():
    out = SeqOutput("r", 1, (7, 8), "ab", finish_reason=FinishReason.LENGTH, usage=Usage(10, 4, 2),
                    timing=Timing(0.01, 0.02, 0.03, 0.04, replica_s=0.125))
    msg = output_to_proto(out, "replica-a")
    assert msg.timing.replica_s == 0.125 and msg.timing.ttft_s == pytest.approx(0.04)
    chunk = Chunk.from_proto(msg, 0.0)
    assert chunk.timing == pytest.approx({"queue_s": 0.01, "prefill_s": 0.02, "decode_s": 0.03,
                                          "ttft_s": 0.04, "replica_s": 0.125})
    assert chunk.finish_reason == "length" and chunk.replica_id == "replica-a"
    middle = output_to_proto(SeqOutput("r", 1, (6,), "x"), "replica-a")
    assert not middle.HasField("timing")  # only the last message carries it
