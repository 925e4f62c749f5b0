"""TLS on the router's client port, mutual TLS between router and workers, API-key rotation.
Certificates are made at test time (trustme, kvfleet.tls); no key material is committed."""

from __future__ import annotations

import json

import grpc
import pytest
import trustme

from kvfleet.client import AsyncClient
from kvfleet.tls import WORKER_CHANNEL_OPTIONS, InternalTLS
from kvfleet.tls_ca import generate_internal_tls, renew_internal_tls
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.routing_fleet import prompt


@pytest.fixture
def client_port_cert(tmp_path):
    """(CA file, cert file, key file) of a server certificate for 127.0.0.1."""
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(files[0]))
    files[1].write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(files[2]))
    return tuple(str(f) for f in files)


async def _complete(client: AsyncClient, max_tokens: int = 3) -> int:
    chunks = [c async for c in client.stream(token_ids=prompt(1, 20), max_tokens=max_tokens,
                                             ignore_eos=True)]
    return chunks[-1].completion_tokens


async def test_the_client_port_serves_tls_and_refuses_plaintext(fleet, client_port_cert):
    ca, cert, key = client_port_cert
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(tls_cert=cert, tls_key=key)
    await fleet.wait_replicas(1)
    client = AsyncClient(router.address, tls_ca=ca)
    try:
        assert await _complete(client) == 3
    finally:
        await client.close()
    plain = AsyncClient(router.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _complete(plain)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await plain.close()


async def _direct(address: str, credentials=None) -> int:
    req = worker_pb2.WorkerGenerateRequest(request_id="direct-1", tenant="default",
                                           prompt_token_ids=prompt(2, 20))
    req.sampling.max_tokens = 2
    if credentials is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, credentials, options=WORKER_CHANNEL_OPTIONS)
    async with channel:
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(channel).Generate(req, timeout=10)]
    return msgs[-1].usage.completion_tokens


async def test_workers_require_the_cluster_certificate(fleet, tmp_path):
    tls = generate_internal_tls(tmp_path / "internal")
    assert oct((tmp_path / "internal" / "router.key").stat().st_mode & 0o777) == "0o600"
    server = await fleet.add_replica("rep-a", internal_tls_dir=str(tmp_path / "internal"))
    router = await fleet.add_router(internal_tls_dir=str(tmp_path / "internal"))
    await fleet.wait_replicas(1)
    client = AsyncClient(router.address)
    try:
        assert await _complete(client) == 3  # router -> worker over mutual TLS
    finally:
        await client.close()
    assert await _direct(server.address, tls.router_credentials()) == 2
    other = generate_internal_tls(tmp_path / "other")  # a certificate from another CA
    refused = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=tls.ca),
        "another cluster's certificate": grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=other.router_key,
            certificate_chain=other.router_cert),
    }
    for what, creds in refused.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _direct(server.address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what
    assert InternalTLS.load(tmp_path / "internal") == tls
    with pytest.raises(FileNotFoundError, match="ca.pem"):
        InternalTLS.load(tmp_path / "missing")


async def test_api_keys_are_reloaded_without_a_restart(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"old-key": "acme"}))
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(api_keys_file=str(keys))
    await fleet.wait_replicas(1)
    old, new = AsyncClient(router.address, api_key="old-key"), AsyncClient(router.address,
                                                                         api_key="new-key")
    try:
        assert await _complete(old) == 3
        keys.write_text("{not json")
        assert not router.reload_api_keys()  # a broken file keeps the previous keys
        assert await _complete(old) == 3
        for empty in ({}, {"keys": {}}):  # zero keys would open the router: refused
            keys.write_text(json.dumps(empty))
            assert not router.reload_api_keys()
            assert await _complete(old) == 3
        keys.write_text(json.dumps({"new-key": "acme"}))
        assert router.reload_api_keys()  # what SIGHUP does
        assert await _complete(new) == 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _complete(old)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await old.close()
        await new.close()


def test_kvfleet_up_serves_tls_outside_and_mutual_tls_inside(ray_session, redis_server,
                                                            tiny_llama_dir, client_port_cert,
                                                            tmp_path):
    from dataclasses import replace

    from kvfleet.client import Client
    from kvfleet.deploy.cli import build_parser
    from kvfleet.deploy.cluster_flags import cluster_config
    from kvfleet.deploy.launcher import LocalCluster

    ca, cert, key = client_port_cert
    internal = tmp_path / "internal"  # empty: kvfleet up generates the cluster CA there
    args = build_parser().parse_args(
        ["up", "--model", str(tiny_llama_dir), "--executor", "cost-model", "--replicas", "1",
         "--cost-model-scale", "0.001", "--num-blocks", "64", "--port", "0",
         "--redis-url", redis_server.url, "--tls-cert", cert, "--tls-key", key,
         "--internal-tls-dir", str(internal)])
    cfg = cluster_config(args)
    cluster = LocalCluster(replace(cfg, replica=replace(cfg.replica, namespace="kvtest-tls:"),
                                   replica_num_cpus=0))
    try:
        cluster.start()
        assert sorted(p.name for p in internal.iterdir()) == sorted(
            ["ca.pem", "ca.key", "worker.pem", "worker.key", "router.pem", "router.key",
             "replica.pem", "replica.key"])
        with Client(cluster.router_address, tls_ca=ca) as client:
            chunks = list(client.stream("Once upon a time", max_tokens=3, ignore_eos=True))
        assert chunks[-1].completion_tokens == 3
    finally:
        cluster.stop()


def _leaf_creds(tls: InternalTLS, ca: bytes) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=tls.router_key,
                                        certificate_chain=tls.router_cert)


def _first_pem(bundle: bytes) -> bytes:
    end = b"-----END CERTIFICATE-----\n"
    return bundle[:bundle.index(end) + len(end)]


async def test_certificates_rotate_from_the_same_directory_without_a_restart(fleet, tmp_path):
    """Item 15: renew in place (here with a new CA, the hard case), workers serve the new
    certificate from their next handshake, routers take it on SIGHUP; a broken set is never
    loaded."""
    d = tmp_path / "internal"
    first = generate_internal_tls(d)
    (d / "ca.key").unlink()  # the CA cannot sign again: renewal makes a new one
    a = await fleet.add_replica("rep-a", internal_tls_dir=str(d))
    router = await fleet.add_router(internal_tls_dir=str(d))
    await fleet.wait_replicas(1)
    client = AsyncClient(router.address)
    try:
        assert await _complete(client) == 3
        second = renew_internal_tls(d)
        new_ca = _first_pem(second.ca)
        assert new_ca != first.ca and first.ca in second.ca  # the bundle trusts both for now
        # The running worker now presents the new certificate: a client trusting only the new
        # CA accepts it, and old router certificates are still accepted during the overlap.
        assert await _direct(a.address, _leaf_creds(second, new_ca)) == 2
        assert await _direct(a.address, _leaf_creds(first, second.ca)) == 2
        # The transition ends: only the new CA is trusted anywhere.
        (d / "ca.pem").write_bytes(new_ca)
        with pytest.raises(grpc.aio.AioRpcError):
            await _direct(a.address, _leaf_creds(first, new_ca))
        assert await _direct(a.address, _leaf_creds(second, new_ca)) == 2
        # A half-written set is refused and the worker keeps serving what it had.
        (d / "worker.pem").write_bytes(first.worker_cert)  # not worker.key's certificate
        assert await _direct(a.address, _leaf_creds(second, new_ca)) == 2
        (d / "worker.pem").write_bytes(second.worker_cert)
        # The router reloads on SIGHUP; a replica started now only knows the new CA.
        assert router.reload_internal_tls()
        await fleet.add_replica("rep-b", internal_tls_dir=str(d))
        await a.stop(grace_s=0.1)
        del fleet.replicas["rep-a"]
        await fleet.wait_replicas(1)
        assert await _complete(client) == 3  # router -> rep-b with the new router certificate
    finally:
        await client.close()


async def test_a_router_keeps_its_certificates_when_the_new_files_are_broken(fleet, tmp_path):
    d = tmp_path / "internal"
    generate_internal_tls(d)
    router = await fleet.add_router(internal_tls_dir=str(d))
    before = router.replicas.credentials
    (d / "router.key").write_bytes(generate_internal_tls(tmp_path / "other").router_key)
    assert not router.reload_internal_tls()
    assert router.replicas.credentials is before


async def test_replicas_beyond_loopback_never_serve_plaintext(fleet, tmp_path):
    """Item 12: a replica bound to every interface without internal TLS refuses to start;
    with it, a plaintext caller is refused."""
    with pytest.raises(ValueError, match="internal_tls_dir"):
        fleet.replica_config("rep-open", host="0.0.0.0")
    generate_internal_tls(tmp_path / "internal")
    server = await fleet.add_replica("rep-wide", host="0.0.0.0",
                                     internal_tls_dir=str(tmp_path / "internal"))
    port = server.address.rsplit(":", 1)[1]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _direct(f"127.0.0.1:{port}")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_http_port_serves_https_with_the_same_certificate(fleet, client_port_cert):
    # Issue 24 item 14: --tls-cert/--tls-key covered only the gRPC port.
    import ssl

    import httpx
    import openai

    ca, cert, key = client_port_cert
    await fleet.add_replica("rep-a")
    router = await fleet.add_router(tls_cert=cert, tls_key=key, http_port=0)
    await fleet.wait_replicas(1)
    trusted = ssl.create_default_context(cafile=ca)
    async with httpx.AsyncClient(verify=trusted) as http:
        async with openai.AsyncOpenAI(base_url=f"https://{router.http_address}/v1", api_key="-",
                                      http_client=http, max_retries=0) as client:
            out = await client.completions.create(model="tiny-llama", prompt="Once upon a time",
                                                  max_tokens=3, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 3
    async with httpx.AsyncClient() as untrusted:  # the system CAs do not know this one
        with pytest.raises(httpx.ConnectError):
            await untrusted.get(f"https://{router.http_address}/health")
    async with httpx.AsyncClient() as plain:  # plaintext HTTP on the TLS port is refused
        with pytest.raises(httpx.HTTPError):
            await plain.get(f"http://{router.http_address}/health")
