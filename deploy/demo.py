"""``kvfleet demo``: start a local cluster, send a realistic shared-prefix chat workload, print a
table per request, check that prefix-aware routing paid off, and shut down.

Two "assistants" with different multi-block system prompts each get one warm-up question,
then the remaining questions arrive concurrently. Every follow-up should land on the replica
that served its assistant's warm-up and reuse the system prompt's full blocks.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from kvfleet.client import AsyncClient, RequestStats
from kvfleet.deploy.cluster_config import ClusterConfig
from kvfleet.deploy.launcher import LocalCluster
from kvfleet.deploy.trace_report import DEFAULT_JAEGER_URL, breakdown_table, jaeger_reachable
from kvfleet.telemetry import Telemetry

SYSTEM_PROMPTS = {
    "geography": (
        "You are a patient geography tutor for secondary-school students. Answer in one "
        "or two short sentences, name the country or region you are talking about, prefer "
        "well-established facts over trivia, and never invent statistics. If a question is "
        "ambiguous, answer the most common reading of it and say which reading you chose. "
        "When a student asks about a capital city, give the city and the country together. "
        "When a student asks about rivers, mountains or oceans, mention the continent as well. "
        "Keep a warm and encouraging tone, and do not ask follow-up questions."
    ),
    "cooking": (
        "You are a friendly kitchen assistant for home cooks with little equipment. Give "
        "practical answers in at most two sentences, mention quantities in grams or millilitres, "
        "suggest a simple substitute when an ingredient is hard to find, and remind the cook "
        "about food safety only when it truly matters for the dish being discussed. Assume a "
        "standard home stove, one pot, one pan and an oven, and no special gadgets. When timing "
        "matters, give the time in minutes, and when heat matters, say low, medium or high. "
        "Keep a calm and encouraging tone, and do not ask follow-up questions."
    ),
}
QUESTIONS = {
    "geography": ["What is the capital of France?", "Which river flows through Cairo?",
                  "What is the largest ocean on Earth?"],
    "cooking": ["How long does a medium potato take to bake?",
                "What can I use instead of buttermilk?", "How do I keep rice from sticking?"],
}
MAX_TOKENS = 48


@dataclass
class Result:
    group: str
    question: str
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: float = 0.0
    text: str = ""
    finish: str = ""
    stats: RequestStats = field(default_factory=RequestStats)  # timing breakdown, trace id


async def _ask(client: AsyncClient, group: str, question: str, echo: bool) -> Result:
    res = Result(group, question)
    start = time.monotonic()
    arrivals: list[float] = []
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[group]},
                {"role": "user", "content": question}]
    async for chunk in client.stream(messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                     stats=res.stats):
        if chunk.token_ids:
            arrivals.append(chunk.received_s)
        res.text += chunk.text
        if echo:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.finish_reason:
            res.finish, res.replica = chunk.finish_reason, chunk.replica_id
            res.prompt_tokens, res.cached_tokens = chunk.prompt_tokens, chunk.cached_prompt_tokens
            res.output_tokens = chunk.completion_tokens
    if echo:
        sys.stdout.write("\n")
    res.ttft_s = (arrivals[0] - start) if arrivals else float("nan")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    res.itl_s = statistics.fmean(gaps) if gaps else float("nan")
    return res


def _print_breakdown(results: list[Result], cfg: ClusterConfig, jaeger_url: str) -> None:
    exported = cfg.replica.telemetry.tracing_enabled
    link = jaeger_url if exported and jaeger_reachable(jaeger_url) else None
    print("\nwhere the time went (worker clock for queue/prefill/decode; network = router "
          "dispatch − worker; other = router + client↔router):")
    print(breakdown_table([(f"[{r.group}] {r.question}", r.stats) for r in results], link))
    if not exported:
        print("traces were not exported: set OTEL_EXPORTER_OTLP_ENDPOINT (see docs/tracing.md) "
              "to see them in Jaeger")
    elif link is None:
        print(f"traces exported to {cfg.replica.telemetry.traces_endpoint()}; no Jaeger UI answered at "
              f"{jaeger_url} (docker compose -f deploy/compose/docker-compose.yaml up -d)")
    else:
        print(f"open {jaeger_url} and pick service kvfleet-client, or follow the links above")


def _table(results: list[Result]) -> str:
    head = f"{'#':>2} {'group':<10} {'replica':<16} {'prompt':>6} {'cached':>6} {'TTFT ms':>8} " \
           f"{'ITL ms':>7} {'out':>4}  question"
    rows = [head, "-" * len(head)]
    for i, r in enumerate(results):
        rows.append(f"{i:>2} {r.group:<10} {r.replica:<16} {r.prompt_tokens:>6} "
                    f"{r.cached_tokens:>6} {r.ttft_s * 1e3:>8.1f} {r.itl_s * 1e3:>7.1f} "
                    f"{r.output_tokens:>4}  {r.question}")
    return "\n".join(rows)


def check_routing(results: list[Result], block_size: int) -> list[str]:
    """Problems found: a follow-up not on its warm-up's replica, or not reusing its prefix."""
    problems = []
    warm = {}
    for r in results:
        if r.group not in warm:
            warm[r.group] = r
            continue
        w = warm[r.group]
        if r.replica != w.replica:
            problems.append(f"{r.question!r} went to {r.replica}, its prefix was on {w.replica}")
        # The system prompt's full blocks (at least) must be reused.
        if r.cached_tokens < block_size * 2:
            problems.append(f"{r.question!r} reused only {r.cached_tokens} prompt tokens")
    return problems


async def _workload(address: str, telemetry: Optional[Telemetry] = None) -> list[Result]:
    async with AsyncClient(address, telemetry=telemetry) as client:
        results = []
        for group in QUESTIONS:
            print(f"\n[{group}] {QUESTIONS[group][0]}", flush=True)
            results.append(await _ask(client, group, QUESTIONS[group][0], echo=True))
        rest = [(g, q) for g, qs in QUESTIONS.items() for q in qs[1:]]
        print(f"\nsending {len(rest)} follow-up questions concurrently…", flush=True)
        results += await asyncio.gather(*(_ask(client, g, q, echo=False) for g, q in rest))
        return results


def run_demo(cfg: ClusterConfig, trace: bool = False,
             jaeger_url: str = DEFAULT_JAEGER_URL) -> int:
    """Run the demo; returns 0 when every follow-up was routed to its prefix and reused it.

    ``trace``: the client traces every request too (one trace per request, exported where
    ``cfg.replica.telemetry`` says) and a per-request time breakdown is printed, with Jaeger links.
    """
    print(f"starting {cfg.replicas} replicas of {cfg.replica.model_name} (this loads the model)…", flush=True)
    telemetry = Telemetry(cfg.replica.telemetry, "client") if trace else None
    try:
        with LocalCluster(cfg) as cluster:
            address = cluster.router_address
            assert address is not None  # set once the cluster has started
            print(f"kvfleet ready: router at {address}", flush=True)
            results = asyncio.run(_workload(address, telemetry))
    finally:
        if telemetry is not None:
            telemetry.shutdown()  # the cluster flushed its spans on stop; these are the client's
    print()
    print(_table(results))
    if trace:
        _print_breakdown(results, cfg, jaeger_url)
    for r in results[len(QUESTIONS):]:
        print(f"  [{r.group}] {r.question} → {r.text.strip()[:100]!r}")
    problems = check_routing(results, cfg.replica.block_size)
    if problems:
        print("\nprefix-aware routing check FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\nprefix-aware routing check passed: every follow-up ran on the replica holding its "
          "system prompt and reused its cached blocks.")
    return 0
