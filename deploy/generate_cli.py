"""``kvfleet generate``: stream one completion from a running router to stdout."""

from __future__ import annotations

import argparse
import os
import sys

from kvfleet.arg_types import non_empty, positive_seconds

DEFAULT_ROUTER = "127.0.0.1:50051"


def add_parser(sub) -> None:
    """The ``generate`` subcommand on ``sub`` (argparse subparsers)."""
    gen = sub.add_parser("generate", help="stream one completion from a running router")
    gen.add_argument("--prompt", required=True, type=non_empty("--prompt"))
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--model", default="")
    gen.add_argument("--adapter", default="", help="a LoRA adapter the replicas serve, by name")
    gen.add_argument("--router", default=DEFAULT_ROUTER)
    gen.add_argument("--api-key")
    gen.add_argument("--tls-ca", help="PEM CA certificate: connect over TLS, trusting it")
    gen.add_argument("--timeout", type=positive_seconds, help="deadline in seconds (> 0)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfleet.client import Client

    kwargs = dict(model=args.model or "", adapter=args.adapter, max_tokens=args.max_tokens,
                  temperature=args.temperature, seed=args.seed)
    if args.raw:
        kwargs["prompt"] = args.prompt
    else:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    client = Client(args.router, api_key=args.api_key, tls_ca=args.tls_ca)
    stream = client.stream(timeout=args.timeout, **kwargs)
    last = None
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    except KeyboardInterrupt:
        stream.close()  # cancels the call: the router aborts it on the worker
        sys.stdout.write("\n")
        print("kvfleet: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Not client.close(): gRPC's channel close can block after a wait that a signal
        # interrupted (seen in a fresh-user run); the process is ending anyway.
        os._exit(130)
    finally:
        client.close()  # not reached after os._exit
    sys.stdout.write("\n")
    if last is not None and last.finish_reason:
        print(f"[{last.finish_reason}: {last.completion_tokens} tokens from {last.replica_id}, "
              f"{last.cached_prompt_tokens}/{last.prompt_tokens} prompt tokens cached]",
              file=sys.stderr)
    return 0
