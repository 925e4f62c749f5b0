"""guidellm (the benchmark client vLLM users run) against the HTTP front: every request succeeds.

    pip install 'guidellm==0.8.1'    # or: pip install -e '.[guidellm]'
    .venv/bin/python -m bench guidellm [--requests 24] [--rate 4] [--endpoint chat|completions]

guidellm is driven through its own command line, as a new user would: ``guidellm run`` with
synthetic text prompts (the default model's tokenizer, from its local directory), streaming
with ``stream_options: {include_usage, continuous_usage_stats}`` (its default), a constant rate
and a request count. The fleet is :func:`bench.zero_fleet.zero_fleet` with the HTTP front: one
cost-model replica that answers at once, so this checks the protocol, not speed. guidellm's
JSON report gives the successful / errored / incomplete counts and the token counts it read
from the streamed usage; the bench fails (exit 1) unless every request succeeded with the
output tokens asked for. Without guidellm installed it says so and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common.result_file import write_json

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def guidellm_command(target: str, model: str, tokenizer_dir: str, endpoint: str, requests: int,
                     rate: float, prompt_tokens: int, output_tokens: int, out: Path) -> list[str]:
    """The ``guidellm run`` command line for one run against ``target`` (``http://host:port``)."""
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={target},model={model},"
                         f"request_format={ROUTES[endpoint]}",
            "--profile", f"kind=constant,rate={rate}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                      f"output_tokens={output_tokens}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def summarize(report: dict, output_tokens: int) -> dict:
    """Request counts and the output tokens guidellm read, from its JSON report."""
    (bench,) = report["benchmarks"]
    requests = bench["requests"]
    ok = requests.get("successful") or []
    tokens = [r.get("output_tokens") or 0 for r in ok]
    return {"successful": len(ok), "errored": len(requests.get("errored") or []),
            "incomplete": len(requests.get("incomplete") or []),
            "output_tokens_as_asked": sum(t == output_tokens for t in tokens),
            "output_tokens_seen": sorted(set(tokens))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.guidellm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--endpoint", choices=sorted(ROUTES), default="chat")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    a = p.parse_args(argv)
    if importlib.util.find_spec("guidellm") is None:
        print("guidellm is not installed: pip install 'guidellm==0.8.1'", file=sys.stderr)
        return 2
    from bench.cluster.router_bench import wait_registered
    from bench.cluster.zero_fleet import zero_fleet

    with zero_fleet("bench-guidellm:", http=True) as fleet, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(wait_registered(fleet.cluster.router_address, 1))
        out = Path(tmp) / "guidellm.json"
        cmd = guidellm_command(f"http://{fleet.cluster.http_address}", fleet.name,
                               fleet.model_dir, a.endpoint, a.requests, a.rate,
                               a.prompt_tokens, a.output_tokens, out)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if run.returncode != 0 or not out.exists():
            print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", file=sys.stderr)
            return 1
        result = {"endpoint": a.endpoint, "requests": a.requests, "rate": a.rate,
                  **summarize(json.loads(out.read_text()), a.output_tokens)}
    print(json.dumps(result))
    write_json(f"guidellm-{a.endpoint}.json", result)
    ok = result["successful"] == result["output_tokens_as_asked"] == a.requests
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
