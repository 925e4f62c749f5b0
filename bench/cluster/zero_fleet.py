"""One router and one cost-model replica that answers at once (``ZERO`` step time), on a
private Redis and a local 2-CPU Ray: the fleet through which the router's own cost is measured
(:mod:`bench.cluster.router_cost`, :mod:`bench.cluster.http_front`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, NamedTuple

if TYPE_CHECKING:
    from kvfleet.deploy.launcher import LocalCluster
    from kvfleet.deploy.redis_server import RedisServer


class ZeroFleet(NamedTuple):
    """The started fleet, and the default model's served ``name`` and ``model_dir``."""

    cluster: LocalCluster
    redis: RedisServer
    name: str
    model_dir: str


@contextmanager
def zero_fleet(namespace: str, http: bool = False) -> Iterator[ZeroFleet]:
    """Start the fleet under Redis key prefix ``namespace`` (with the router's HTTP front on a
    free port when ``http``), yield it, and stop cluster, Ray and Redis on the way out."""
    from kvfleet.deploy.cluster_config import ClusterConfig
    from kvfleet.deploy.launcher import LocalCluster
    from kvfleet.deploy.models import DEFAULT_MODEL, resolve_model
    from kvfleet.deploy.ray_local import init_ray, shutdown_ray
    from kvfleet.deploy.redis_server import start_redis
    from kvfleet.router.config import RouterConfig
    from kvfleet.worker.executor.cost_model import ZERO
    from kvfleet.worker.replica.replica import ReplicaConfig

    name, model_dir = resolve_model(DEFAULT_MODEL)
    redis = start_redis()
    init_ray(num_cpus=2)
    cluster = LocalCluster(ClusterConfig(
        ReplicaConfig(name, name, str(model_dir), num_blocks=4096, redis_url=redis.url,
                      namespace=namespace, executor="cost-model", cost_model=ZERO),
        RouterConfig(port=0, http_port=0 if http else None), replicas=1, replica_num_cpus=0))
    try:
        cluster.start()
        yield ZeroFleet(cluster, redis, name, str(model_dir))
    finally:
        cluster.stop()
        shutdown_ray()
        redis.stop()
