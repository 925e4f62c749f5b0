"""``kvfleet k8s render``: write the Kubernetes manifests (kvfleet.deploy.k8s) for the
chosen model, GPU shape and fleet size.

Exit codes: 0 written, 2 a usage or configuration error (the message names the flag).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Optional

from kvfleet.deploy.cluster_flags import AUTOSCALE_FLAGS, add_cluster_args, autoscale_config
from kvfleet.deploy.k8s import write
from kvfleet.deploy.k8s_config import K8sConfig

# flag → (K8sConfig field, type, help)
FLAGS = {
    "--name": ("name", str, "object name prefix"),
    "--image": ("image", str, "container image with kvfleet and Ray installed"),
    "--model": ("model_name", str, "served model: a directory of that name on the models volume"),
    "--models-claim": ("models_claim", str, "PersistentVolumeClaim holding the model directories"),
    "--tp": ("tp", int, "GPUs per worker pod = tensor-parallel ranks per replica"),
    "--replicas": ("replicas", int, "replicas (one per worker pod) in the Serve config"),
    "--min-replicas": ("min_replicas", int, "worker pods the autoscaler keeps"),
    "--max-replicas": ("max_replicas", int, "worker pods the autoscaler may run"),
    "--router-replicas": ("router_replicas", int, "router pods"),
    "--worker-cpus": ("worker_cpus", int, "CPUs per worker pod"),
    "--worker-memory": ("worker_memory", str, "memory per worker pod (a Kubernetes quantity)"),
    "--kv-memory-bytes": ("kv_memory_bytes", int, "KV-cache bytes per rank"),
    "--kv-host-memory-bytes": ("kv_host_memory_bytes", int, "host KV tier bytes per node "
                                                          "(default: none; inside --worker-memory)"),
    "--kv-prewarm-s": ("kv_prewarm_s", float, "seconds a new replica may restore its node "
                                              "tier's blocks before serving (0: off)"),
    "--kv-write-back-queue-bytes": ("kv_write_back_queue_bytes", int,
                                    "write-back bytes a rank queues for the node tier at once "
                                    "(what does not fit is dropped)"),
    "--kv-write-back-run-bytes": ("kv_write_back_run_bytes", int,
                                  "the most bytes one put into the node tier carries"),
    "--dtype": ("dtype", str, "weights and KV dtype"),
    "--drain-timeout": ("drain_timeout_s", float, "seconds a stopping replica or router lets "
                                                 "its streams run on"),
    "--itl-target-ms": ("itl_target_ms", float, "the replicas' inter-token latency target "
                                                "(kvfleet up --itl-target-ms; default off)"),
    "--revision": ("revision", str, "rollout label: a new one replaces every replica in "
                                    "place, one at a time"),
    "--traces-endpoint": ("traces_endpoint", str, "OTLP/gRPC endpoint the collector sends "
                                                  "traces to"),
}


def build_parser() -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in fields(K8sConfig)}
    p = argparse.ArgumentParser(prog="kvfleet k8s", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="write the manifests into --out")
    render.add_argument("--out", default="deploy/k8s", help="directory (default deploy/k8s)")
    for flag, (name, kind, text) in FLAGS.items():
        # Fleet sizes default to None here: --autoscale must know whether they were given.
        sized = name in _SIZES
        render.add_argument(flag, dest=name, type=kind, default=None if sized else defaults[name],
                            help=f"{text} (default {defaults[name]})")
    add_cluster_args(render, "k8s", AUTOSCALE_FLAGS)
    return p


_SIZES = ("replicas", "min_replicas", "max_replicas")


def k8s_config(args: argparse.Namespace) -> K8sConfig:
    """The K8sConfig of parsed ``render`` flags. Raises ValueError naming the flag."""
    values = {name: getattr(args, name) for name, _, _ in FLAGS.values()}
    autoscale = autoscale_config(args)
    if autoscale is not None:
        given = [f for f, (name, _, _) in FLAGS.items() if name in _SIZES and values[name] is not None]
        if given:
            raise ValueError(f"{given[0]} and --autoscale exclude each other: the replicas start "
                             f"at MIN and the worker pods range over MIN..MAX")
        t = autoscale.targets
        values.update(replicas=t.min_replicas, min_replicas=t.min_replicas,
                      max_replicas=t.max_replicas)
    values = {k: v for k, v in values.items() if v is not None}
    return K8sConfig(autoscale=autoscale, **values)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        k = k8s_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in write(k, args.out):
        print(path)
    return 0
