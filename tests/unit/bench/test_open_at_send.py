"""The overload bench's count of a tenant's own requests open on a replica when each was sent."""

from bench.cluster.overload import Outcome, open_at_send, open_counts, summarize


def out(sent: float, end: float, replica: str, code: str = "OK") -> Outcome:
    return Outcome("steady", sent, end=end, first=sent + 0.1, code=code, replica=replica,
                   worker_queue_s=0.0, worker_ttft_s=0.05)


def test_open_requests_are_counted_per_replica_at_each_send():
    outs = [out(0.0, 3.0, "a"), out(1.0, 2.0, "a"), out(1.5, 4.0, "a"), out(1.2, 5.0, "b"),
            out(2.5, 2.6, "a"), out(0.5, 0.6, "", code="RESOURCE_EXHAUSTED")]
    # At 1.5 on "a": the 0.0 and 1.0 requests; at 2.5: the 0.0 and 1.5 ones (1.0 ended at 2.0).
    assert sorted(open_counts(outs)) == [0, 0, 1, 2, 2]
    assert open_at_send(outs, outs[2]) == 2
    s = summarize(outs)
    assert s["by_replica"] == {"a": 4, "b": 1} and s["open_at_send"]["max"] == 2
