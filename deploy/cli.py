"""The ``kvfleet`` command: up, scale, status, generate, demo, budget, model.

Diagnostics go to stderr; generated text to stdout. Exit codes: 0 ok, 1 a gRPC/runtime
failure (the status is printed), 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional

import grpc

DEFAULT_ROUTER = "127.0.0.1:50051"


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    from kvfleet.deploy.models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"served model name or HF-format directory (default {DEFAULT_MODEL})")
    p.add_argument("--replicas", type=int, default=2, help="worker replicas (default 2)")
    p.add_argument("--tp", dest="tensor_parallel_size", type=_positive_int("--tp"), default=1,
                   help="tensor-parallel ranks per replica (default 1): each rank holds 1/T of "
                        "the projections and of the KV heads; --num-blocks/--kv-memory are per rank")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: one GPU per rank, NCCL between ranks (default cpu, gloo)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="KV blocks per replica (on every rank)")
    size.add_argument("--kv-memory", help="KV memory per replica rank, e.g. 256MiB (default 256MiB)")
    p.add_argument("--policy", default="prefix_aware",
                   choices=["prefix_aware", "least_loaded", "round_robin"], help="routing policy")
    p.add_argument("--admission", default="watermark", choices=["watermark", "reserve"],
                   help="worker admission policy (default watermark)")
    p.add_argument("--no-one-row-weights", dest="one_row_weights", action="store_false",
                   help="hold each weight once: halves weight memory, batch-1 decode ~20%% slower "
                        "(default: a second copy streams faster for one-row decode steps)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="serve the PEFT LoRA adapter in DIR as NAME (repeatable)")
    p.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                   help="serve every adapter subdirectory of DIR, named by it (repeatable)")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="`kvfleet adapter load` may read adapters under DIR (repeatable; the "
                        "--adapter and --adapter-dir directories are allowed too; any other "
                        "path is refused PERMISSION_DENIED)")
    p.add_argument("--max-loras", type=_positive_int("--max-loras"), default=4,
                   help="LoRA adapter slots per replica, LRU (default 4)")
    p.add_argument("--max-lora-rank", type=_positive_int("--max-lora-rank"), default=64,
                   help="largest adapter rank accepted (default 64)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--port", type=int, default=50051, help="router port (0 = a free port)")
    p.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    p.add_argument("--replica-host", default="127.0.0.1",
                   help="interface the replicas serve gRPC on (default 127.0.0.1; 0.0.0.0 on a "
                        "cluster spanning hosts: each replica registers its node's address)")
    p.add_argument("--api-keys", help="JSON file mapping API keys to tenants (default: open)")
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus metrics: the router on this port, replica i on port+1+i "
                        "(0 = free ports). Traces and OTLP metrics follow OTEL_* variables, "
                        "e.g. OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317")
    p.add_argument("--executor", default="model", choices=["model", "cost-model"],
                   help="model: the real forward; cost-model: a timed stand-in for the forward "
                        "only (scheduler, KV cache, index, gRPC stay real; many per process)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="calibration JSON for --executor cost-model (default: the constants "
                        "measured on SmolLM2 by bench/calibrate.py)")
    p.add_argument("--cost-model-scale", type=float, default=1.0,
                   help="multiply the cost model's step times (e.g. 0.05 = 20x faster)")
    p.add_argument("--tls-cert", help="PEM certificate: serve the router's client port over TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--internal-tls-dir",
                   help="mutual TLS between router and workers with this directory's cluster "
                        "CA (generated there when empty)")
    p.add_argument("--drain-timeout", type=_positive_seconds, default=30.0,
                   help="seconds a stopping replica (scale-down, upgrade, Ctrl-C) waits for "
                        "its streams before ending them UNAVAILABLE (default 30)")
    p.add_argument("--tenant-share", type=float, default=1.0,
                   help="fraction of a replica's running + waiting slots one tenant may hold "
                        "(default 1: no per-tenant cap)")


def _non_empty(flag: str):
    """argparse type: a string that is not empty or only whitespace (else a usage error)."""
    def check(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{flag} must not be empty")
        return value
    return check


def _positive_int(flag: str):
    """argparse type: an integer >= 1 (else a usage error naming ``flag``)."""
    def check(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {value!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {n}")
        return n
    return check


def _positive_seconds(value: str) -> float:
    """argparse type: a finite number of seconds > 0 (a deadline already past is a usage error)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value}")
    return seconds


def cluster_config(args: argparse.Namespace):
    """Build a ClusterConfig from parsed args. Raises ModelNotPrepared / ValueError."""
    from kvfleet.allocator.units import parse_size
    from kvfleet.deploy.launcher import ClusterConfig
    from kvfleet.deploy.models import resolve_model
    from kvfleet.worker.engine.scheduler import SchedulerConfig
    from kvfleet.worker.executor.cost_model import MEASURED, CostModel
    from kvfleet.worker.replica.adapter_catalog import adapter_roots

    from kvfleet.telemetry import TelemetryConfig

    name, model_dir = resolve_model(args.model)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch sees no CUDA device "
                             f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    if args.tensor_parallel_size != 1:  # refuse a split the model cannot take before starting
        from kvfleet.worker.runner.model_config import load_model_config
        from kvfleet.worker.runner.tp.layout import check_tp

        check_tp(load_model_config(model_dir), args.tensor_parallel_size)
    adapters = _checked_adapters(args, model_dir)
    for root in args.adapter_root:
        if not os.path.isdir(root):
            raise ValueError(f"--adapter-root {root}: not a directory")
    cost = CostModel.load(args.cost_model) if args.cost_model else MEASURED
    if args.cost_model_scale != 1.0:
        cost = cost.scaled(args.cost_model_scale)
    return ClusterConfig(
        model_name=name, model_dir=str(model_dir), replicas=args.replicas,
        block_size=args.block_size, num_blocks=args.num_blocks, one_row_weights=args.one_row_weights,
        kv_memory_bytes=parse_size(args.kv_memory, "--kv-memory") if args.kv_memory else None,
        policy=args.policy, port=args.port, redis_url=args.redis_url,
        ray_address=args.ray_address, replica_host=args.replica_host,
        api_keys_file=args.api_keys,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=args.admission, tenant_share=args.tenant_share),
        tls_cert=args.tls_cert, tls_key=args.tls_key, internal_tls_dir=args.internal_tls_dir,
        executor=args.executor, cost_model=cost if args.executor == "cost-model" else None,
        tensor_parallel_size=args.tensor_parallel_size, device=args.device,
        adapters=adapters, max_loras=args.max_loras,
        adapter_roots=adapter_roots(adapters, args.adapter_dir, args.adapter_root),
        max_lora_rank=args.max_lora_rank,
        telemetry=TelemetryConfig.from_env(os.environ), metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout,
        http_port=None if getattr(args, "http_port", -1) < 0 else args.http_port,
        # -vv: the router logs each routing decision (candidates' matches and loads) too
        router_args=("--log-level", "DEBUG") if getattr(args, "verbose", 0) >= 2 else ())


def _checked_adapters(args: argparse.Namespace, model_dir) -> tuple[tuple[str, str], ...]:
    """``--adapter`` / ``--adapter-dir`` as (name, dir) pairs, each checked against the model
    before anything starts. Raises ValueError (AdapterError) naming the adapter, file and field."""
    from kvfleet.worker.replica.adapter_catalog import (
        check_catalog,
        expand_adapter_dirs,
        parse_adapter_arg,
    )
    from kvfleet.worker.runner.model_config import load_model_config

    pairs = expand_adapter_dirs([parse_adapter_arg(a) for a in args.adapter], args.adapter_dir)
    if pairs:
        check_catalog(pairs, load_model_config(model_dir), args.max_lora_rank)
    return pairs


def cmd_up(args: argparse.Namespace) -> int:
    from kvfleet.deploy.launcher import LocalCluster

    cluster = LocalCluster(cluster_config(args))
    stop = threading.Event()

    def on_signal(*_) -> None:
        stop.set()

    try:
        address = cluster.start()
        # After start: ray.init installs its own SIGTERM handler (it aborts the process).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        http = (f"OpenAI-compatible HTTP at http://{cluster.http_address}/v1; "
                if cluster.http_address else "")
        print(f"kvfleet ready: router at {address} ({args.replicas} replica{'s' if args.replicas != 1 else ''} of {args.model}); "
              f"{http}Ctrl-C to stop", flush=True)
        print(f"kvfleet: prefix index in Redis at {cluster.redis_url} (keys {cluster.cfg.namespace}*)",
              file=sys.stderr, flush=True)
        _record_cluster(cluster)
        for name, metrics in cluster.metrics_addresses.items():
            print(f"kvfleet: {name} metrics at http://{metrics}/metrics", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        print(f"kvfleet: stopping (draining replicas, up to {args.drain_timeout:g} s)…",
              file=sys.stderr, flush=True)
        from kvfleet.deploy.operate import remove_cluster_file

        remove_cluster_file(os.getpid())
        cluster.stop()
    return 0


def _record_cluster(cluster) -> None:
    """Tell other terminals (``kvfleet scale`` / ``status``) where this cluster is."""
    import ray
    from kvfleet.deploy.operate import write_cluster_file

    address = ray.get_runtime_context().gcs_address
    path = write_cluster_file({"ray_address": address, "namespace": cluster.cfg.namespace,
                               "router": cluster.router_address, "pid": os.getpid()})
    print(f"kvfleet: Ray at {address} (recorded in {path}): `kvfleet status`, "
          f"`kvfleet scale --replicas N` from another terminal", file=sys.stderr, flush=True)


def _operator_target(args: argparse.Namespace) -> tuple[Optional[str], Optional[str]]:
    """(Ray address, kvfleet namespace) of the cluster ``scale``/``status`` act on."""
    import json

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

    _, namespace = _operator_target(args)
    ref = find_app(namespace, args.model)
    model_dir = os.path.abspath(os.path.expanduser(args.model_dir)) if args.model_dir else None
    if model_dir is not None and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--model-dir {args.model_dir}: no config.json there")
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
    import json

    from kvfleet.deploy.operate import cluster_status
    from kvfleet.deploy.status import format_status

    _, namespace = _operator_target(args)
    status = cluster_status(namespace, args.model)
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


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


def cmd_demo(args: argparse.Namespace) -> int:
    from kvfleet.deploy.demo import run_demo

    return run_demo(cluster_config(args), trace=args.trace, jaeger_url=args.jaeger_url)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet", description="kvfleet LLM serving cluster")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="INFO logs on stderr; -vv: DEBUG, and the router logs every routing "
                        "decision")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local cluster and serve until Ctrl-C")
    _add_cluster_args(up)
    up.add_argument("--http-port", type=int, default=8000,
                    help="the router's OpenAI-compatible HTTP API (default 8000; 0 = a free "
                         "port, -1 = off)")
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser("demo", help="start a local cluster, send a shared-prefix workload, stop")
    _add_cluster_args(demo)
    demo.add_argument("--trace", action="store_true",
                      help="trace every request and print its queue / prefill / decode / network "
                           "breakdown (and its Jaeger link when Jaeger answers at --jaeger-url)")
    demo.add_argument("--jaeger-url", default="http://127.0.0.1:16686",
                      help="Jaeger UI for trace links (default http://127.0.0.1:16686)")
    demo.set_defaults(func=cmd_demo, port=0)

    for name, helptext in (("scale", "change a running cluster's replica count in place"),
                           ("upgrade", "roll a running cluster's replicas to a new revision, "
                                       "new ones serving before old ones drain"),
                           ("status", "a running cluster's replicas, routers and Redis")):
        op = sub.add_parser(name, help=helptext)
        op.add_argument("--address", help="Ray address of the cluster (default: the one "
                                          "`kvfleet up` recorded on this machine)")
        op.add_argument("--namespace", help="kvfleet namespace (default: the recorded one)")
        op.add_argument("--model", help="served model name (default: the only one)")
        if name == "scale":
            op.add_argument("--replicas", type=_positive_int("--replicas"), required=True)
            op.add_argument("--no-wait", action="store_true",
                            help="return once applied, not when the replicas serve")
            op.add_argument("--timeout", type=_positive_seconds, default=600.0,
                            help="seconds to wait for the new count to serve (default 600)")
            op.set_defaults(func=cmd_scale)
        elif name == "upgrade":
            op.add_argument("--revision", required=True, type=_non_empty("--revision"),
                            help="label of the new revision (a new value replaces every replica)")
            op.add_argument("--model-dir", help="the new revision's model directory "
                                                "(default: the current one)")
            op.add_argument("--no-wait", action="store_true",
                            help="return once applied, not when the rollout is done")
            op.add_argument("--timeout", type=_positive_seconds, default=600.0,
                            help="seconds to wait for the rollout (default 600)")
            op.set_defaults(func=cmd_upgrade)
        else:
            op.add_argument("--json", action="store_true", help="machine-readable output")
            op.set_defaults(func=cmd_status)

    gen = sub.add_parser("generate", help="stream one completion from a running router")
    gen.add_argument("--prompt", required=True, type=_non_empty("--prompt"))
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--model", default="")
    gen.add_argument("--adapter", default="", help="a LoRA adapter the replicas serve, by name")
    gen.add_argument("--router", default=DEFAULT_ROUTER)
    gen.add_argument("--api-key")
    gen.add_argument("--tls-ca", help="PEM CA certificate: connect over TLS, trusting it")
    gen.add_argument("--timeout", type=_positive_seconds, help="deadline in seconds (> 0)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.set_defaults(func=cmd_generate)

    sub.add_parser("budget", help="KV-cache byte budget from a config.json (see `kvfleet budget -h`)",
                   add_help=False)
    sub.add_parser("model", help="prepare or locate models (see `kvfleet model -h`)", add_help=False)
    sub.add_parser("adapter", help="load, unload or list LoRA adapters of a running cluster "
                                   "(see `kvfleet adapter -h`)", add_help=False)
    sub.add_parser("k8s", help="render the Kubernetes (KubeRay) manifests (see `kvfleet k8s -h`)",
                   add_help=False)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands with their own parsers.
    if argv and argv[0] == "budget":
        from kvfleet.deploy.budget import main as budget_main
        return budget_main(argv[1:])
    if argv and argv[0] == "adapter":
        from kvfleet.deploy.adapter_cli import main as adapter_main
        return adapter_main(argv[1:])
    if argv and argv[0] == "model":
        from kvfleet.deploy.models import main as model_main
        return model_main(argv[1:])
    if argv and argv[0] == "k8s":
        from kvfleet.deploy.k8s_cli import main as k8s_main
        return k8s_main(argv[1:])
    args = build_parser().parse_args(argv)
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
