"""Peer pulls between replicas with internal mutual TLS (issue 26 §2). A pull has two legs: the
``Worker.ExportBlocks`` call from the pulling replica to the holder (gRPC: kvfleet's internal
TLS applies), and the KV bytes through the node's tier actor (Ray's object store: kvfleet's
TLS does not apply; Ray's own transport carries them). A worker's port accepts only the
router's certificate, and a replica holds only the worker certificate (server
authentication), so a replica with internal TLS does not pull: it builds no puller, a hinted
request is served by recomputing it, and the holder's ``ExportBlocks`` refuses a caller
without the router's certificate (plaintext, or a replica's own certificate) without
exporting anything. Real replicas (gRPC with TLS, the node tier as a Ray actor)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.tls import WORKER_CHANNEL_OPTIONS, generate_internal_tls
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from kvfleet.worker.kv_tier.node_tier import node_tier
from kvfleet.worker.kv_tier.peer_client import GrpcPeerClient
from kvfleet.worker.kv_tier.peer_pull import PeerHint
from kvfleet.worker.replica.replica import ReplicaServer
from tests.integration.test_kv_hand_over import PROMPT, _config, _no_tier_actor
from tests.integration.test_kv_peer_pull import hinted_request


async def _generate(server: ReplicaServer, creds, rid: str, peer: ReplicaServer | None = None):
    """The last message of ``PROMPT`` on ``server`` over mutual TLS with ``creds`` (a hint
    naming ``peer`` as the holder of its 2 full blocks)."""
    req = hinted_request(rid, PROMPT, peer)
    async with grpc.aio.secure_channel(server.address, creds,
                                       options=WORKER_CHANNEL_OPTIONS) as channel:
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Generate(req, timeout=30)]
    assert msgs and msgs[-1].HasField("usage")
    return msgs[-1]


async def test_replicas_with_internal_tls_do_not_pull_and_refuse_exports_to_peers(
        ray_session, tiny_llama_dir, redis_server, redis_namespace, tmp_path) -> None:
    _no_tier_actor(ray_session)
    tls = generate_internal_tls(tmp_path / "internal")
    creds = tls.router_credentials()

    def config(rid: str):
        return dataclasses.replace(_config(rid, tiny_llama_dir, redis_server.url,
                                           redis_namespace),
                                   internal_tls_dir=str(tmp_path / "internal"))

    a, b = ReplicaServer(config("a")), ReplicaServer(config("b"))
    try:
        await a.start()
        await b.start()
        assert a.service.puller is None and b.service.puller is None  # no pull under TLS
        assert (await _generate(a, creds, "a-1")).usage.cached_prompt_tokens == 0
        hinted = await _generate(b, creds, "b-1", peer=a)
        assert hinted.usage.cached_prompt_tokens == 0  # recomputed, no error
        assert len(hinted.token_ids) >= 1
        assert a.engine.exports.exported_blocks == 0

        root = root_hash(a.engine.identity_digest, "default", "")
        hashes = block_hash_chain(root, PROMPT, 16)[:2]
        assert a.engine.kv.pool.lookup(hashes[0]) is not None  # A holds what would be asked
        client = GrpcPeerClient()  # the plaintext client a pulling replica would use
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.export(PeerHint("a", a.address, 2), hashes, 5.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake
        finally:
            await client.close()
        replica_cert = grpc.ssl_channel_credentials(  # a replica's own certificate
            root_certificates=tls.ca, private_key=tls.worker_key,
            certificate_chain=tls.worker_cert)
        async with grpc.aio.secure_channel(a.address, replica_cert,
                                           options=WORKER_CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(channel).ExportBlocks(
                    worker_pb2.ExportBlocksRequest(block_hashes=hashes, timeout_s=5.0),
                    timeout=10)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.PERMISSION_DENIED)
        assert a.engine.exports.exported_blocks == 0  # nothing left A for a peer
        assert node_tier(16 << 20).stats().blocks == 0
    finally:
        await a.stop()
        await b.stop()
        ray_session.kill(node_tier(16 << 20).actor)
