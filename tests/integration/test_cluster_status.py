"""``Router.ClusterStatus`` lists what the registry holds when it is called: a replica that
registered a moment ago (after ``kvfleet up`` said ready) is listed, not only after the
router's next periodic read."""

from __future__ import annotations

import grpc

from kvfleet.v1 import router_pb2, router_pb2_grpc


async def test_cluster_status_lists_a_replica_registered_since_the_last_periodic_read(fleet):
    router = await fleet.add_router()
    assert not router.replicas.replicas
    # Only ClusterStatus's own read can now list the replica: the periodic one is stopped.
    task = router.replicas._task
    assert task is not None
    task.cancel()
    await fleet.add_replica("rep-a")
    async with grpc.aio.insecure_channel(router.address) as channel:
        status = await router_pb2_grpc.RouterStub(channel).ClusterStatus(
            router_pb2.ClusterStatusRequest())
    assert [r.replica_id for r in status.replicas] == ["rep-a"]
    assert status.replicas[0].lifecycle.state == "serving"
