"""The ``kvfleet`` command: up, demo, scale, upgrade, status, generate, budget, model, adapter,
k8s, tls.

Diagnostics go to stderr; generated text to stdout. Exit codes: 0 ok, 1 a gRPC/runtime
failure (the status is printed), 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

import grpc

from kvfleet.deploy import generate_cli, operate_cli, up_cli

# Subcommands with parsers of their own: name -> (module, help).
OWN_PARSERS = {
    "budget": ("kvfleet.deploy.budget",
               "KV-cache byte budget from a config.json (see `kvfleet budget -h`)"),
    "model": ("kvfleet.deploy.models", "prepare or locate models (see `kvfleet model -h`)"),
    "adapter": ("kvfleet.deploy.adapter_cli", "load, unload or list LoRA adapters of a running "
                                              "cluster (see `kvfleet adapter -h`)"),
    "k8s": ("kvfleet.deploy.k8s_cli", "render the Kubernetes (KubeRay) manifests "
                                      "(see `kvfleet k8s -h`)"),
    "tls": ("kvfleet.deploy.tls_cli", "renew or inspect the internal TLS certificates "
                                      "(see `kvfleet tls -h`)"),
}
CLUSTER_COMMANDS = ("up", "demo")


def build_parser(cluster_flags: bool = True) -> argparse.ArgumentParser:
    """The whole parser. ``cluster_flags`` False: ``up`` / ``demo`` are listed without their
    flags (which import the worker and router configs, torch included: seconds of start-up
    a ``kvfleet generate`` need not pay)."""
    p = argparse.ArgumentParser(prog="kvfleet", description="kvfleet LLM serving cluster")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="INFO logs on stderr; -vv: DEBUG, and the router logs every routing "
                        "decision")
    sub = p.add_subparsers(dest="command", required=True)
    if cluster_flags:
        up_cli.add_parsers(sub)
    else:
        for name in CLUSTER_COMMANDS:
            sub.add_parser(name, add_help=False)
    operate_cli.add_parsers(sub)
    generate_cli.add_parser(sub)
    for name, (_, helptext) in OWN_PARSERS.items():
        sub.add_parser(name, help=helptext, add_help=False)
    return p


def model_refusal(argv: list[str]) -> Optional[str]:
    """Why ``--model`` (default: the default model) cannot be served, checked before the
    cluster flags' parser loads (it imports torch and the worker: seconds), or None. Only the
    model's family and config fields are judged here (torch-free), and for a model the
    transformers fallback would run, its class and what ``--model-impl``, ``--tp``,
    ``--quantization`` and ``--layer-yield`` ask of it (that imports transformers); an
    unprepared or missing model, and every other flag, are left to the full parse."""
    from kvfleet.deploy.models import DEFAULT_MODEL, ModelNotPrepared, resolve_model
    from kvfleet.worker.runner.fallback.check import FallbackRequest
    from kvfleet.worker.runner.model_impl import MODEL_IMPLS
    from kvfleet.worker.runner.models import check_model_dir

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default=DEFAULT_MODEL)
    pre.add_argument("--model-impl", default="auto")
    pre.add_argument("--tp", default="1")
    pre.add_argument("--quantization", default="none")
    pre.add_argument("--layer-yield", default="auto")
    known, _ = pre.parse_known_args(argv)
    if known.model_impl not in MODEL_IMPLS or not known.tp.isdigit():
        return None  # the full parser names the bad value
    try:
        _, model_dir = resolve_model(known.model)
    except (ModelNotPrepared, OSError):
        return None
    try:
        check_model_dir(model_dir, known.model_impl,
                        FallbackRequest(int(known.tp), known.quantization,
                                        known.layer_yield == "on"))
    except ValueError as exc:  # UnsupportedModel, ConfigError, ShardingError: they name it
        return str(exc)
    return None


def _supervise_cluster(argv: list[str]) -> bool:
    """Whether this ``kvfleet`` process should supervise ``up`` or ``demo`` (each starts a
    cluster) rather than run it: not for help, not inside the supervised process itself, and
    only where the parent-death signal exists."""
    import os

    from kvfleet.deploy import own_session

    command = next((a for a in argv if not a.startswith("-")), None)
    return (command in CLUSTER_COMMANDS and not {"-h", "--help"} & set(argv)
            and own_session.SUPERVISED_ENV not in os.environ and own_session.supported())


def main(argv: Optional[list[str]] = None) -> int:
    """Run the ``kvfleet`` command line ``argv`` (default: this process's arguments) and return
    its exit code. Started as a command (``argv`` None), ``up`` and ``demo`` run their cluster in
    a session of its own under a supervisor that forwards the signals
    (kvfleet.deploy.own_session)."""
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if from_command_line and _supervise_cluster(argv):
        from kvfleet.deploy import own_session

        return own_session.run_in_own_session([sys.executable, "-m", "kvfleet.deploy.cli", *argv])
    if argv and argv[0] in OWN_PARSERS:
        import importlib

        return importlib.import_module(OWN_PARSERS[argv[0]][0]).main(argv[1:])
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in CLUSTER_COMMANDS and (refusal := model_refusal(argv)) is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    args = build_parser(cluster_flags=command in CLUSTER_COMMANDS or command is None
                        ).parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvfleet.deploy.models import ModelNotPrepared

    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before the cluster was up: it cleaned up already
        print("kvfleet: interrupted", file=sys.stderr)
        return 130
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (TimeoutError, RuntimeError) as exc:  # scale: the new count did not come up
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ModelNotPrepared, FileNotFoundError, ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
