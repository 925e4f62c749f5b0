"""Fixtures of the integration tests that are not whole-session components."""

from __future__ import annotations

import pytest

from tests.integration.routing_fleet import running_fleet


@pytest.fixture
async def fleet(redis_server, redis_namespace, tiny_llama_dir):
    """An empty in-process fleet (add replicas and routers in the test); stopped afterwards."""
    async with running_fleet(redis_server.url, redis_namespace, str(tiny_llama_dir)) as f:
        yield f


@pytest.fixture
async def long_fleet(redis_server, redis_namespace, tiny_llama_long_dir):
    """As ``fleet``, serving the tiny Llama with an 8,192-token context."""
    async with running_fleet(redis_server.url, redis_namespace, str(tiny_llama_long_dir)) as f:
        yield f
