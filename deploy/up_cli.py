"""``kvfleet up`` (a local cluster until Ctrl-C) and ``kvfleet demo`` (a cluster, a workload,
stop): their parsers take the cluster flags (kvfleet.deploy.cluster_flags)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def add_parsers(sub) -> None:
    """The ``up`` and ``demo`` subcommands on ``sub`` (argparse subparsers)."""
    from kvfleet.deploy.cluster_flags import add_cluster_args

    up = sub.add_parser("up", help="start a local cluster and serve until Ctrl-C")
    add_cluster_args(up, "up")
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser("demo", help="start a local cluster, send a shared-prefix workload, stop")
    observability = add_cluster_args(demo, "demo")["observability"]
    observability.add_argument("--trace", action="store_true",
                      help="trace every request and print its queue / prefill / decode / network "
                           "breakdown (and its Jaeger link when Jaeger answers at --jaeger-url)")
    observability.add_argument("--jaeger-url", default="http://127.0.0.1:16686",
                      help="Jaeger UI for trace links (default http://127.0.0.1:16686)")
    demo.set_defaults(func=cmd_demo, router__port=0)


def cmd_up(args: argparse.Namespace) -> int:
    from kvfleet.deploy.cluster_flags import cluster_config
    from kvfleet.deploy.launcher import LocalCluster
    from kvfleet.deploy.operate import remove_cluster_file

    cluster = LocalCluster(cluster_config(args))
    stop = threading.Event()

    def on_signal(*_) -> None:
        stop.set()

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    # While starting, SIGTERM / SIGHUP interrupt like Ctrl-C: start() then stops what it
    # started (the private redis-server included) instead of the process dying around it.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        address = cluster.start()
        # After start: ray.init installs its own SIGTERM handler (it aborts the process).
        # SIGHUP too: a closed terminal drains and stops the cluster like Ctrl-C.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        http = (f"OpenAI-compatible HTTP at http://{cluster.http_address}/v1; "
                if cluster.http_address else "")
        n = cluster.cfg.replicas
        print(f"kvfleet ready: router at {address} ({n} replica{'s' if n != 1 else ''} of "
              f"{args.model}); {http}Ctrl-C to stop", flush=True)
        print(f"kvfleet: prefix index in Redis at {cluster.redis_url} "
              f"(keys {cluster.cfg.replica.namespace}*)", file=sys.stderr, flush=True)
        _record_cluster(cluster)
        for name, metrics in cluster.metrics_addresses.items():
            print(f"kvfleet: {name} metrics at http://{metrics}/metrics", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        try:
            print(f"kvfleet: stopping (draining replicas, up to "
                  f"{cluster.cfg.replica.drain_timeout_s:g} s)…", file=sys.stderr, flush=True)
        except OSError:  # stderr is gone (a closed pipe or terminal): stop everything all the same
            pass
        remove_cluster_file(os.getpid())
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _record_cluster(cluster) -> None:
    """Tell other terminals (``kvfleet scale`` / ``status``) where this cluster is."""
    import ray

    from kvfleet.deploy.operate import write_cluster_file

    address = ray.get_runtime_context().gcs_address
    path = write_cluster_file({"ray_address": address, "namespace": cluster.cfg.replica.namespace,
                               "router": cluster.router_address, "pid": os.getpid()})
    print(f"kvfleet: Ray at {address} (recorded in {path}): `kvfleet status`, "
          f"`kvfleet scale --replicas N` from another terminal", file=sys.stderr, flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvfleet.deploy.cluster_flags import cluster_config
    from kvfleet.deploy.demo import run_demo

    return run_demo(cluster_config(args), trace=args.trace, jaeger_url=args.jaeger_url)
