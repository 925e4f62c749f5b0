"""Peer pulls between replicas with internal mutual TLS, and each role holding only its own
certificates. A pull has two legs: the ``Worker.ExportBlocks`` call from the pulling replica to
the holder (gRPC: kvfleet's internal TLS applies) and the KV bytes through the node's tier
actor (Ray's object store: Ray's own transport carries them). The pulling replica presents the
replica certificate, which the holder accepts for ``ExportBlocks`` only; the replicas' TLS
directory holds no router key, so no replica can call another as the router. Real replicas
(gRPC with TLS, the node tier as a Ray actor)."""

from __future__ import annotations

import dataclasses
import shutil

import grpc
import pytest

from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.tls import REPLICA_FILES, WORKER_CHANNEL_OPTIONS, WORKER_FILES, InternalTLS
from kvfleet.tls_ca import generate_internal_tls
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.kv_tier.node_tier import remove_node_tiers
from kvfleet.worker.replica.replica import ReplicaServer
from tests.integration.test_kv_hand_over import PROMPT, _config, _no_tier_actor
from tests.integration.test_kv_peer_pull import EXPENSIVE, hinted_request


async def _generate(server: ReplicaServer, creds, rid: str, peer: ReplicaServer | None = None):
    """The last message of ``PROMPT`` on ``server`` over mutual TLS with ``creds`` (a hint
    naming ``peer`` as the holder of its 2 full blocks)."""
    req = hinted_request(rid, PROMPT, peer)
    async with grpc.aio.secure_channel(server.address, creds,
                                       options=WORKER_CHANNEL_OPTIONS) as channel:
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Generate(req, timeout=30)]
    assert msgs and msgs[-1].HasField("usage")
    return msgs[-1]


def _as(tls: InternalTLS, cert: bytes, key: bytes) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=key,
                                        certificate_chain=cert)


async def test_replicas_pull_over_tls_with_the_replica_certificate_and_hold_no_router_key(
        ray_session, tiny_llama_dir, redis_server, redis_namespace, tmp_path) -> None:
    _no_tier_actor(redis_namespace)
    tls = generate_internal_tls(tmp_path / "internal")
    workers = tmp_path / "workers"  # what a worker pod mounts: no router.pem / router.key
    workers.mkdir(mode=0o700)
    for name in WORKER_FILES + REPLICA_FILES:
        shutil.copy2(tmp_path / "internal" / name, workers / name)
    router = tls.router_credentials()

    def config(rid: str):
        return dataclasses.replace(_config(rid, tiny_llama_dir, redis_server.url,
                                           redis_namespace), internal_tls_dir=str(workers))

    a, b = ReplicaServer(config("a")), ReplicaServer(config("b"))
    try:
        await a.start()
        await b.start()
        assert b.service.puller is not None  # a peer identity: pulls under TLS
        b.service.puller.step_cost = EXPENSIVE
        assert (await _generate(a, router, "a-1")).usage.cached_prompt_tokens == 0
        hinted = await _generate(b, router, "b-1", peer=a)
        assert hinted.usage.cached_prompt_tokens == 32  # pulled from A over TLS, restored
        assert b.service.puller.stats.pulls == 1 and a.engine.exports.exported_blocks == 2

        root = root_hash(a.engine.identity_digest, "default", "")
        hashes = block_hash_chain(root, PROMPT, 16)[:2]
        replica = _as(tls, tls.replica_cert, tls.replica_key)
        async with grpc.aio.secure_channel(a.address, replica,
                                           options=WORKER_CHANNEL_OPTIONS) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for call in (stub.Generate(hinted_request("r-1", PROMPT)).read(),
                         stub.Stats(worker_pb2.StatsRequest(), timeout=10),
                         stub.Drain(worker_pb2.DrainRequest(), timeout=10)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call  # the replica certificate is for ExportBlocks only
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "kvfleet-replica" in (err.value.details() or "")
            exported = await stub.ExportBlocks(
                worker_pb2.ExportBlocksRequest(block_hashes=hashes, timeout_s=5.0), timeout=10)
            assert list(exported.block_hashes) == hashes
        # A worker's own certificate is a server certificate: no client can present it.
        worker = _as(tls, tls.worker_cert, tls.worker_key)
        async with grpc.aio.secure_channel(a.address, worker,
                                           options=WORKER_CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(),
                                                                timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # refused at the handshake
        assert not a.drained
    finally:
        await a.stop()
        await b.stop()
        remove_node_tiers(redis_namespace)
