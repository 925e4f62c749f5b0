"""``kvfleet adapter load NAME DIR | unload NAME | list``: LoRA adapters of a running cluster,
through the router (which applies a load or unload on every live replica of the model).

``DIR`` is a PEFT adapter directory as the replicas' hosts see it (made absolute here, for a
local cluster). Exit codes: 0 done everywhere, 1 a gRPC error or a replica refused, 2 usage.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

PROG = "kvfleet adapter"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--api-key", help="an adapter admin's key (the key file's adapter_admins)")
    p.add_argument("--model", default="", help="served model (default: the router's default)")
    sub = p.add_subparsers(dest="action", required=True)
    load = sub.add_parser("load", help="serve an adapter directory under NAME")
    load.add_argument("name")
    load.add_argument("dir")
    unload = sub.add_parser("unload", help="stop serving NAME")
    unload.add_argument("name")
    sub.add_parser("list", help="adapters served, with revision and residency")
    return p


def main(argv: list[str]) -> int:
    """Run ``kvfleet adapter`` with ``argv`` (after the subcommand name)."""
    from kvfleet.client import Client

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    with Client(args.router, api_key=args.api_key) as client:
        try:
            if args.action == "list":
                for m in client.list_models().models:
                    for a in m.adapters:
                        print(f"{m.name}\t{a.name}\t{a.revision}\t{a.replicas} replicas, "
                              f"{a.resident_replicas} resident")
                return 0
            reply = (client.load_adapter(args.name, os.path.abspath(args.dir), args.model)
                     if args.action == "load" else client.unload_adapter(args.name, args.model))
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    for r in reply.results:
        print(f"{r.replica_id}\t{r.error or ('revision ' + r.revision if r.revision else 'ok')}")
    return 1 if any(r.error for r in reply.results) else 0
