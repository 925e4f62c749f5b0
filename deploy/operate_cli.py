"""``kvfleet scale``, ``upgrade`` and ``status``: act on a running cluster from any terminal
(kvfleet.deploy.operate)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from kvfleet.arg_types import non_empty, positive_int, positive_seconds


def add_parsers(sub) -> None:
    """The ``scale``, ``upgrade`` and ``status`` subcommands on ``sub`` (argparse subparsers)."""
    scale = _operator(sub, "scale", "change a running cluster's replica count in place")
    scale.add_argument("--replicas", type=positive_int("--replicas"), required=True)
    scale.add_argument("--no-wait", action="store_true",
                       help="return once applied, not when the replicas serve")
    scale.add_argument("--timeout", type=positive_seconds, default=600.0,
                       help="seconds to wait for the new count to serve (default 600)")
    scale.set_defaults(func=cmd_scale)

    upgrade = _operator(sub, "upgrade", "roll a running cluster's replicas to a new revision, "
                                        "new ones serving before old ones drain")
    upgrade.add_argument("--revision", required=True, type=non_empty("--revision"),
                         help="label of the new revision (a new value replaces every replica)")
    upgrade.add_argument("--model-dir", help="the new revision's model directory "
                                             "(default: the current one)")
    upgrade.add_argument("--no-wait", action="store_true",
                         help="return once applied, not when the rollout is done")
    upgrade.add_argument("--timeout", type=positive_seconds, default=600.0,
                         help="seconds to wait for the rollout (default 600)")
    upgrade.set_defaults(func=cmd_upgrade)

    status = _operator(sub, "status", "a running cluster's replicas, routers and Redis")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)


def _operator(sub, name: str, helptext: str) -> argparse.ArgumentParser:
    op = sub.add_parser(name, help=helptext)
    op.add_argument("--address", help="Ray address of the cluster (default: the one "
                                      "`kvfleet up` recorded on this machine)")
    op.add_argument("--namespace", help="kvfleet namespace (default: the recorded one)")
    op.add_argument("--model", help="served model name (default: the only one)")
    return op


def _operator_target(args: argparse.Namespace) -> tuple[Optional[str], Optional[str]]:
    """(Ray address, kvfleet namespace) of the cluster ``scale``/``status`` act on."""
    from kvfleet.deploy.operate import cluster_file, connect

    connect(args.address)
    namespace = args.namespace
    if namespace is None and not args.address:
        try:
            namespace = json.loads(cluster_file().read_text()).get("namespace")
        except (OSError, ValueError):
            namespace = None
    return args.address, namespace


def cmd_scale(args: argparse.Namespace) -> int:
    from kvfleet.deploy.operate import find_app

    _, namespace = _operator_target(args)
    ref = find_app(namespace, args.model)
    before = len(ref.registered())
    ref.scale(args.replicas)
    print(f"kvfleet: {ref.model}: {before} → {args.replicas} replicas applied "
          f"(Serve application {ref.name})", file=sys.stderr, flush=True)
    if args.no_wait:
        return 0
    serving = ref.wait_serving(args.replicas, args.timeout)
    for info in serving:
        print(f"{info.replica_id} epoch {info.epoch} serving at {info.address}")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from kvfleet.deploy.operate import find_app

    # Checked before anything connects: a typo fails at once, with no cluster touched.
    model_dir = os.path.abspath(os.path.expanduser(args.model_dir)) if args.model_dir else None
    if model_dir is not None and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--model-dir {args.model_dir}: no config.json there")
    _, namespace = _operator_target(args)
    ref = find_app(namespace, args.model)
    print(f"kvfleet: {ref.model}: rolling every replica to revision {args.revision!r} "
          f"(Serve application {ref.name})", file=sys.stderr, flush=True)
    if args.no_wait:
        from kvfleet.deploy import serve_control

        serve_control.set_revision(ref.name, args.revision, model_dir)
        return 0
    for info in ref.upgrade(args.revision, model_dir, args.timeout):
        print(f"{info.replica_id} epoch {info.epoch} serving at {info.address}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvfleet.deploy.operate import cluster_status
    from kvfleet.deploy.status import format_status

    _, namespace = _operator_target(args)
    status = cluster_status(namespace, args.model)
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0
