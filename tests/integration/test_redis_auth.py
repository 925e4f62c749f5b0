"""Routers and workers against a Redis that wants a password (``redis://:pw@…``) and one
that speaks TLS only (``rediss://…``, server certificate made at test time by trustme)."""

from __future__ import annotations

import pytest
import redis
import trustme

from kvfleet.deploy.redis_server import RedisTLS, start_redis
from kvfleet.index_keys import redis_client
from tests.integration.routing_fleet import BLOCK, prompt, running_fleet

PASSWORD = "s3cret/with:odd@chars"


@pytest.fixture(params=["password", "password+tls"])
def private_redis(request, tmp_path):
    tls = None
    if request.param.endswith("tls"):
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        tls = RedisTLS(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"),
                       str(tmp_path / "ca.pem"))
        (tmp_path / "cert.pem").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(tls.key_file)
        ca.cert_pem.write_to_path(tls.ca_file)
    server = start_redis(password=PASSWORD, tls=tls)
    yield server
    server.stop()


async def test_routers_and_workers_use_a_redis_with_password_and_tls(private_redis,
                                                                     tiny_llama_dir):
    url = private_redis.url
    assert url.startswith("rediss://" if private_redis.tls else "redis://")
    # The server really wants the password (and TLS): the same URL without it is refused.
    bare = url.replace(url[url.index("//") + 2:url.index("@") + 1], "")
    client = redis_client(bare)
    try:
        with pytest.raises(redis.AuthenticationError):
            await client.ping()
    finally:
        await client.aclose()
    async with running_fleet(url, "kvtest-auth:", str(tiny_llama_dir)) as fleet:
        await fleet.add_replica("rep-a")
        await fleet.add_replica("rep-b")
        await fleet.add_router()
        await fleet.wait_replicas(2)  # registrations and heartbeats went through Redis
        tokens = prompt(1, 3 * BLOCK)
        first = await fleet.generate(tokens)
        chain = fleet.chain(tokens)
        # The worker's KV events reached the router's index (event log + mirror).
        await fleet.wait_match(chain, {first.replica_id: 3})
        again = await fleet.generate(tokens)
        assert again.replica_id == first.replica_id
        assert again.usage.cached_prompt_tokens == 3 * BLOCK - BLOCK  # the last block recomputed
