"""Fixtures of the integration tests that are not whole-session components."""

from __future__ import annotations

import pytest

from tests.integration.routing_fleet import Fleet


@pytest.fixture
async def fleet(redis_server, redis_namespace, tiny_llama_dir):
    """An empty in-process fleet (add replicas and routers in the test); stopped afterwards."""
    f = Fleet(redis_server.url, redis_namespace, str(tiny_llama_dir))
    try:
        yield f
    finally:
        await f.stop()
