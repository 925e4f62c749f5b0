"""One cost-model replica as its own process, for ``bench.cluster.soak`` (which kills and restarts it).

    python -m bench.cluster.soak_replica --replica-id r0 --redis-url redis://… --model-dir DIR

Prints ``replica ready <host:port>`` once it serves; stops cleanly on SIGTERM/SIGINT (a
SIGKILL is the fault the soak injects). The scheduler, block pool, KV events and gRPC are
real; only the forward is the cost model's sleep (``--scale`` × the measured constants).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from kvfleet.stream_limits import StreamLimits
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.executor.cost_model import MEASURED
from kvfleet.worker.replica.replica import ReplicaConfig, ReplicaServer


def config(argv: list[str]) -> ReplicaConfig:
    """The replica's config from its flags. Raises SystemExit on bad flags."""
    p = argparse.ArgumentParser(prog="bench.cluster.soak_replica", description=__doc__)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--model-name", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--scale", type=float, default=0.05)
    p.add_argument("--num-blocks", type=int, default=640)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--stream-max-unread", type=int, default=64)
    p.add_argument("--stream-stall-s", type=float, default=2.0)
    a = p.parse_args(argv)
    return ReplicaConfig(
        replica_id=a.replica_id, model_name=a.model_name, model_dir=a.model_dir,
        num_blocks=a.num_blocks, redis_url=a.redis_url, namespace=a.namespace,
        executor="cost-model", cost_model=MEASURED.scaled(a.scale), heartbeat_interval_s=0.5,
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=512),
        stream_limits=StreamLimits(a.stream_max_unread, a.stream_stall_s))


async def serve(cfg: ReplicaConfig) -> None:
    server = ReplicaServer(cfg)
    address = await server.start()
    print(f"replica ready {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace_s=0.5)


if __name__ == "__main__":
    asyncio.run(serve(config(sys.argv[1:])))
