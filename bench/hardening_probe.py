"""Issue 24's before/after probes (items 1, 2, 9), each on one in-process component.

    .venv/bin/python -m bench.hardening_probe tokenize --model-dir DIR [--on-loop]
    .venv/bin/python -m bench.hardening_probe merge [--rev REV]
    .venv/bin/python -m bench.hardening_probe idle [--idle-s 2]

``tokenize``: another tenant's inter-token latency (p50/p99/max, ms) on a gRPC stream while
one HTTP request with 64 prompts of 1,000,000 bytes each is tokenized; ``--on-loop`` runs the
tokenizer inline on the event loop, as before the thread pool. ``merge``: of 200 multi-prompt
merges whose consumer stalls, then closes, how many closes never return (each a leaked HTTP
handler and connection slot); ``--rev`` loads ``router/http_streams.py`` from that git
revision instead. ``idle``: seconds until a call to a worker that never answers fails.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def _tokenize(model_dir: str, on_loop: bool) -> dict:
    import grpc
    import httpx

    from kvfleet.deploy.redis_server import start_redis
    from kvfleet.router.core import RouterCore
    from kvfleet.v1 import router_pb2, router_pb2_grpc
    from kvfleet.worker.executor.cost_model import CostModel
    from tests.integration.routing_fleet import Fleet

    if on_loop:  # what the router did before: the tokenizer called inline, on the loop
        async def inline(self, fn, arg):
            return fn(arg)
        RouterCore._off_loop = inline
    redis = start_redis()
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(json.dumps({"key-big": "big", "key-other": "other"}))
    fleet = Fleet(redis.url, "probe:", model_dir)
    try:
        await fleet.add_replica("rep-a", cost_model=CostModel(0.02, 0.0, 0.0, "20 ms per step"))
        router = await fleet.add_router(http_port=0, api_keys_file=str(keys))
        await fleet.wait_replicas(1)
        rng = random.Random(0)
        words = ["alpha", "beta", "gamma", "delta", "tokens", "router", "stream", "cache"]
        text = " ".join(rng.choice(words) for _ in range(200_000))[:1_000_000]
        gaps: list[float] = []
        window: list[float] = []

        async def other() -> None:
            async with grpc.aio.insecure_channel(router.address) as channel:
                req = router_pb2.GenerateRequest(text="Once upon a time")
                req.sampling.max_tokens, req.sampling.ignore_eos = 200, True
                last = None
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(
                        req, metadata=(("authorization", "Bearer key-other"),)):
                    now = time.monotonic()
                    if last is not None and window and now >= window[0] and (
                            len(window) == 1 or last <= window[1]):
                        gaps.append(now - last)
                    last = now

        async def big() -> int:
            await asyncio.sleep(0.5)
            window.append(time.monotonic())
            async with httpx.AsyncClient(timeout=600) as client:
                resp = await client.post(
                    f"http://{router.http_address}/v1/completions",
                    headers={"authorization": "Bearer key-big"},
                    json={"prompt": [text] * 64, "max_tokens": 1})
            window.append(time.monotonic())
            return resp.status_code

        status, _ = await asyncio.gather(big(), other())
        gaps.sort()

        def pick(q: float) -> float:
            return round(1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))], 1)
        return {"on_loop": on_loop, "big_request_status": status,
                "big_request_s": round(window[1] - window[0], 2), "gaps_in_window": len(gaps),
                "itl_p50_ms": pick(0.5) if gaps else None, "itl_p99_ms": pick(0.99) if gaps else None,
                "itl_max_ms": round(1000 * gaps[-1], 1) if gaps else None}
    finally:
        await fleet.stop()
        redis.stop()


async def _merge(rev: str) -> dict:
    if rev:
        src = subprocess.run(["git", "show", f"{rev}:router/http_streams.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        path = Path(tempfile.mkdtemp()) / "http_streams_old.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("http_streams_old", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        from kvfleet.router import http_streams as module

    async def prompt_stream(n: int):
        for i in range(n):
            yield i
            await asyncio.sleep(0)

    leaked = 0
    for _ in range(200):
        merged = module.merge([prompt_stream(1000) for _ in range(4)])
        await merged.__anext__()
        await asyncio.sleep(0.01)  # the client stalls: every pump fills the buffer
        closing = asyncio.ensure_future(merged.aclose())  # then it disconnects
        done, _ = await asyncio.wait({closing}, timeout=1.0)
        leaked += not done
    return {"rev": rev or "working tree", "requests": 200, "closes_never_returned": leaked}


async def _idle(idle_s: float) -> dict:
    import grpc

    from kvfleet.router.worker_link import WorkerCallError, WorkerLink
    from kvfleet.v1 import worker_pb2_grpc

    class Silent(worker_pb2_grpc.WorkerServicer):
        async def GenerateStream(self, request_iterator, context):
            async for _ in request_iterator:
                pass
            if False:
                yield

    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = WorkerLink(channel)
        t0 = time.monotonic()
        try:
            async for _ in link.call(idle_s=idle_s):
                pass
            outcome = "ended"
        except WorkerCallError as exc:
            outcome = exc.code.name
        await link.close()
    await server.stop(0)
    return {"idle_s": idle_s, "outcome": outcome, "seconds_to_error": round(time.monotonic() - t0, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--model-dir", required=True)
    t.add_argument("--on-loop", action="store_true")
    m = sub.add_parser("merge")
    m.add_argument("--rev", default="")
    i = sub.add_parser("idle")
    i.add_argument("--idle-s", type=float, default=2.0)
    a = p.parse_args(argv)
    if a.probe == "tokenize":
        out = asyncio.run(_tokenize(a.model_dir, a.on_loop))
    elif a.probe == "merge":
        out = asyncio.run(_merge(a.rev))
    else:
        out = asyncio.run(_idle(a.idle_s))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
