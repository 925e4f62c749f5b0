"""`kvfleet demo --trace`'s per-request breakdown table."""

from __future__ import annotations

from kvfleet.client import RequestStats
from kvfleet.deploy.trace_report import breakdown_table, jaeger_reachable


def stats(**kw) -> RequestStats:
    base = dict(ttft_s=0.120, total_s=0.500, network_s=0.004, worker_s=0.480, replica_id="replica-0",
                prompt_tokens=134, cached_prompt_tokens=112, trace_id="ab" * 16,
                timing={"queue_s": 0.001, "prefill_s": 0.100, "decode_s": 0.370, "ttft_s": 0.101})
    return RequestStats(**{**base, **kw})


def test_columns_add_up_to_the_client_total():
    table = breakdown_table([("[geo] capital?", stats())], "http://127.0.0.1:16686/")
    row = table.splitlines()[2].split()
    # queue = worker − prefill − decode; other = total − worker − network
    assert row[-10:] == ["replica-0", "112/134", "120.0", "10.0", "100.0", "370.0", "4.0",
                         "16.0", "500.0", "http://127.0.0.1:16686/trace/" + "ab" * 16]


def test_unknown_parts_print_as_dashes_and_no_link_without_a_trace():
    row = breakdown_table([("x", stats(worker_s=None, network_s=None, trace_id=""))]).splitlines()[2]
    assert row.split()[-7:] == ["120.0", "1.0", "100.0", "370.0", "-", "-", "500.0"]
    assert "trace" not in row


def test_jaeger_reachable_is_false_when_nothing_listens():
    assert not jaeger_reachable("http://127.0.0.1:9/", timeout_s=0.2)
