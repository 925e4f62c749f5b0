"""Traces and metrics across real processes: a router process and two Ray-actor replicas, each
exporting OTLP to a collector this test runs in-process (kvfleet.telemetry.collector).

One cluster for the module; the tiny seeded Llama keeps it fast. The scheduler's token budget
is small (32) so that prompts take several prefill chunks.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid

import pytest

from kvfleet.client import Client, RequestStats
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.deploy.launcher import LocalCluster
from kvfleet.router.config import RouterConfig
from kvfleet.telemetry import Telemetry, TelemetryConfig
from kvfleet.telemetry import names as n
from kvfleet.telemetry.collector import OtlpSink
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from tests.fixtures.cluster import tiny_replica, wait_indexed

SYSTEM = ("You are the archive desk of a small-town newspaper. Answer questions about past "
          "issues in one sentence, give the issue date, and never guess a page number.")
SERVER, CLIENT = 2, 3  # OTLP SpanKind
ERROR = 2              # OTLP status code


@pytest.fixture(scope="module")
def sink():
    s = OtlpSink()
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def telemetry_cfg(sink):
    return TelemetryConfig(otlp_endpoint=sink.endpoint, bsp_schedule_delay_s=0.05,
                           metric_export_interval_s=0.25)


@pytest.fixture(scope="module")
def traced_cluster(ray_session, redis_server, tiny_llama_dir, telemetry_cfg):
    replica = tiny_replica(tiny_llama_dir, redis_server.url, f"kvtest-trace-{uuid.uuid4().hex[:6]}:",
                           telemetry=telemetry_cfg,
                           scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))
    cfg = ClusterConfig(replica, RouterConfig(port=0, http_port=0), replicas=2, metrics_port=0,
                        replica_num_cpus=0)  # the session's other cluster may hold every CPU
    cluster = LocalCluster(cfg)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(traced_cluster, telemetry_cfg):
    tel = Telemetry(telemetry_cfg, "client")
    with Client(traced_cluster.router_address, telemetry=tel) as c:
        yield c
    tel.shutdown()


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def trace_spans(sink: OtlpSink, trace_id: str, names: set[str], timeout_s: float = 10.0):
    """name → span for one trace, once every name in ``names`` has arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = {s.name: s for s in sink.spans() if s.trace_id == trace_id}
        if names <= spans.keys() or time.monotonic() > deadline:
            missing = names - spans.keys()
            assert not missing, f"spans never arrived: {sorted(missing)}; got {sorted(spans)}"
            return spans
        time.sleep(0.05)


def ancestors(spans: dict, span) -> list[str]:
    by_id = {s.span_id: s for s in spans.values()}
    out = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        out.append(span.name)
    return out


ALL = {n.CLIENT_GENERATE, n.ROUTER_GENERATE, n.ROUTER_TOKENIZE, n.ROUTER_ROUTE,
       n.ROUTER_DISPATCH, n.WORKER_GENERATE, n.WORKER_QUEUE, n.WORKER_PREFILL, n.WORKER_DECODE}


def test_an_http_request_is_one_trace_under_an_http_server_span(traced_cluster, sink):
    trace_id = uuid.uuid4().hex
    # Not chat(): the other tests count prefill chunks of SYSTEM's uncached prompt.
    body = json.dumps({"messages": [{"role": "user", "content": "When did the paper start?"}],
                       "max_tokens": 3,
                       "user": "reader-7"}).encode()
    req = urllib.request.Request(
        f"http://{traced_cluster.http_address}/v1/chat/completions", data=body,
        headers={"content-type": "application/json",
                 "traceparent": f"00-{trace_id}-{'ab' * 8}-01"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200 and json.load(resp)["usage"]["completion_tokens"] == 3
    http_span = "POST /v1/chat/completions"
    spans = trace_spans(sink, trace_id, ALL - {n.CLIENT_GENERATE, n.ROUTER_GENERATE} | {http_span})
    assert n.ROUTER_GENERATE not in spans  # the HTTP span takes the gRPC one's place
    for name in (n.ROUTER_TOKENIZE, n.ROUTER_ROUTE, n.ROUTER_DISPATCH):
        assert ancestors(spans, spans[name]) == [http_span]
    assert ancestors(spans, spans[n.WORKER_GENERATE])[:2] == [n.ROUTER_DISPATCH, http_span]
    a = spans[http_span].attributes
    assert spans[http_span].kind == SERVER and n.RPC_SYSTEM not in a
    assert a[n.HTTP_REQUEST_METHOD] == "POST" and a[n.HTTP_ROUTE] == "/v1/chat/completions"
    assert a[n.HTTP_RESPONSE_STATUS_CODE] == 200 and a[n.USER_ID] == "reader-7"
    assert a[n.GEN_AI_OPERATION_NAME] == "chat" and a[n.GEN_AI_USAGE_OUTPUT_TOKENS] == 3


def test_one_request_is_one_trace_with_the_span_tree(client, sink):
    stats = RequestStats()
    chunks = list(client.stream(messages=chat("When did the mill close?"), max_tokens=6,
                                ignore_eos=True, stats=stats))
    assert chunks[-1].finish_reason == "length" and stats.trace_id
    spans = trace_spans(sink, stats.trace_id, ALL)
    # router.Generate ⊃ tokenize, route, dispatch ⊃ worker.Generate ⊃ queue, prefill, decode
    assert ancestors(spans, spans[n.ROUTER_GENERATE]) == [n.CLIENT_GENERATE]
    for name in (n.ROUTER_TOKENIZE, n.ROUTER_ROUTE, n.ROUTER_DISPATCH):
        assert ancestors(spans, spans[name])[0] == n.ROUTER_GENERATE
    assert n.ROUTER_DISPATCH in ancestors(spans, spans[n.WORKER_GENERATE])
    for name in (n.WORKER_QUEUE, n.WORKER_PREFILL, n.WORKER_DECODE):
        assert ancestors(spans, spans[name])[:3] == [n.WORKER_GENERATE, n.ROUTER_DISPATCH,
                                                     n.ROUTER_GENERATE]
    assert spans[n.ROUTER_GENERATE].kind == SERVER and spans[n.WORKER_GENERATE].kind == SERVER
    assert spans[n.ROUTER_DISPATCH].kind == CLIENT
    # Router and worker are separate processes (the worker a Ray actor), neither this one.
    router_pid = spans[n.ROUTER_GENERATE].resource[n.PROCESS_PID]
    worker_pid = spans[n.WORKER_GENERATE].resource[n.PROCESS_PID]
    assert len({router_pid, worker_pid, os.getpid()}) == 3
    assert spans[n.WORKER_GENERATE].service == "kvfleet-worker"

    # The phases tile worker.Generate in order, and fit inside it.
    w, q, p, d = (spans[x] for x in (n.WORKER_GENERATE, n.WORKER_QUEUE, n.WORKER_PREFILL,
                                     n.WORKER_DECODE))
    assert (w.start_ns <= q.start_ns <= q.end_ns <= p.start_ns <= p.end_ns <= d.start_ns
            <= d.end_ns <= w.end_ns)
    assert q.duration_s + p.duration_s + d.duration_s <= w.duration_s

    # Network = router.dispatch − worker.Generate, on the span, in the client's stats.
    dispatch = spans[n.ROUTER_DISPATCH]
    network = dispatch.attributes[n.KVFLEET_NETWORK_S]
    assert network >= 0
    assert network == pytest.approx(dispatch.duration_s - w.duration_s, abs=2e-5)
    assert stats.network_s == pytest.approx(network, abs=2e-6)

    # GenAI attributes, and token timing as events (no per-token spans).
    g = spans[n.ROUTER_GENERATE].attributes
    assert g[n.GEN_AI_REQUEST_MODEL] == "tiny-llama" and g[n.GEN_AI_OPERATION_NAME] == "chat"
    assert g[n.GEN_AI_REQUEST_MAX_TOKENS] == 6 and g[n.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert g[n.GEN_AI_USAGE_INPUT_TOKENS] == stats.prompt_tokens > 32
    assert g[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert g[n.KVFLEET_REPLICA_ID] == stats.replica_id
    route = spans[n.ROUTER_ROUTE].attributes
    assert route[n.KVFLEET_ROUTE_POLICY] == "predicted_ttft" and route[n.KVFLEET_ROUTE_INDEX_USED]
    assert route[n.KVFLEET_ROUTE_INDEX_SOURCE] in ("mirror", "redis")  # mirror once it follows
    assert route[n.KVFLEET_ROUTE_PROMPT_BLOCKS] == stats.prompt_tokens // 16
    uncached = stats.prompt_tokens - stats.cached_prompt_tokens
    chunks_attr = p.attributes[n.KVFLEET_PREFILL_CHUNKS]
    assert chunks_attr == -(-uncached // 32) >= 2  # the budget is 32 tokens per step
    events = [e for e in p.events if e[0] == n.EVENT_PREFILL_CHUNK]
    assert len(events) == chunks_attr
    assert sum(e[2][n.KVFLEET_CHUNK_TOKENS] for e in events) == uncached
    assert [e[0] for e in d.events] == [n.EVENT_FIRST_TOKEN]
    assert d.attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert sum(1 for s in sink.spans() if s.trace_id == stats.trace_id) == len(ALL)
    # Client-observed TTFT next to the worker's.
    assert stats.ttft_s >= stats.timing["ttft_s"] > 0
    assert spans[n.CLIENT_GENERATE].attributes[n.KVFLEET_CLIENT_TTFT_S] == pytest.approx(stats.ttft_s)


def test_cancelled_request_spans_end_with_status_and_reason(client, sink):
    stats = RequestStats()
    stream = client.stream(messages=chat("Tell me every headline of 1987."), max_tokens=150,
                           ignore_eos=True, stats=stats)
    next(stream), next(stream)
    stream.close()  # the client goes away mid-stream
    spans = trace_spans(sink, stats.trace_id, {n.ROUTER_GENERATE, n.ROUTER_DISPATCH,
                                               n.WORKER_GENERATE, n.WORKER_DECODE})
    for name in (n.ROUTER_GENERATE, n.ROUTER_DISPATCH, n.WORKER_GENERATE, n.WORKER_DECODE):
        span = spans[name]
        assert span.status_code == ERROR, name
        assert "CANCELLED" in span.status_message, name
        assert span.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("cancelled",), name
    w = spans[n.WORKER_GENERATE]
    assert w.attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] < 150
    assert spans[n.WORKER_DECODE].end_ns <= w.end_ns


def test_prefix_routed_request_reports_its_cached_tokens(client, sink, traced_cluster):
    salt = uuid.uuid4().hex  # a fresh prefix nobody holds yet
    first = RequestStats()
    list(client.stream(messages=chat("Who ran the bakery?"), max_tokens=1, cache_salt=salt,
                       stats=first))
    wait_indexed(traced_cluster, client, first.replica_id, messages=chat("Who ran the bakery?"),
                 cache_salt=salt)
    again = RequestStats()
    list(client.stream(messages=chat("Who ran the post office?"), max_tokens=1, cache_salt=salt,
                       stats=again))
    spans = trace_spans(sink, again.trace_id, {n.ROUTER_GENERATE, n.ROUTER_ROUTE,
                                               n.WORKER_PREFILL})
    route = spans[n.ROUTER_ROUTE].attributes
    assert route[n.KVFLEET_REPLICA_ID] == first.replica_id == again.replica_id
    assert route[n.KVFLEET_ROUTE_MATCHED_BLOCKS] >= 2
    assert again.cached_prompt_tokens >= 32
    assert spans[n.WORKER_PREFILL].attributes[n.KVFLEET_CACHED_PROMPT_TOKENS] == again.cached_prompt_tokens
    router_attrs = spans[n.ROUTER_GENERATE].attributes
    assert router_attrs[n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == again.cached_prompt_tokens
    assert router_attrs[n.KVFLEET_CACHED_PROMPT_TOKENS] == again.cached_prompt_tokens


def _settled(read, timeout_s: float = 10.0, want=None):
    """``read()`` once it stops changing (or reaches ``want``)."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(0.4)
        now = read()
        if (want is not None and now == want) or (want is None and now == last):
            return now
        last = now
    return last


def _prometheus_count(address: str, metric: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(metric + "{") or line.startswith(metric + " "))


def test_histograms_receive_one_ttft_per_request(client, sink, traced_cluster):
    ttft = lambda: sink.histogram_count(n.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)  # noqa: E731
    network = lambda: sink.histogram_count(n.METRIC_NETWORK_DURATION)  # noqa: E731
    before, net_before = _settled(ttft), _settled(network)
    assert before >= 1  # earlier tests' requests
    for i in range(3):
        list(client.stream(messages=chat(f"Question {i}?"), max_tokens=2))
    assert _settled(ttft, want=before + 3) == before + 3
    assert _settled(network, want=net_before + 3) == net_before + 3
    # The same counts on the Prometheus endpoints (--metrics-port).
    replicas = [a for k, a in traced_cluster.metrics_addresses.items() if k != "router"]
    prom = sum(_prometheus_count(a, "gen_ai_server_time_to_first_token_seconds_count")
               for a in replicas)
    assert prom == before + 3
    assert _prometheus_count(traced_cluster.metrics_addresses["router"],
                             "kvfleet_router_network_duration_seconds_count") == net_before + 3
    # KV usage and running/waiting gauges are exported too.
    assert sink.metric_values(n.METRIC_KV_CACHE_USAGE)
    assert sink.metric_values(n.METRIC_REQUESTS, kvfleet__request__state="running")
