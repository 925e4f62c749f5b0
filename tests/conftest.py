"""Shared fixtures live in tests/fixtures/, one module per real component."""

import pytest
from hypothesis import settings

# Tests are never timed.
settings.register_profile("kvfleet", deadline=None, max_examples=100)
settings.load_profile("kvfleet")

from tests.fixtures.redis import redis_namespace, redis_server  # noqa: E402,F401
from tests.fixtures.models import (llama_8q2kv_dir, llama_8q4kv_dir,  # noqa: E402,F401
                                   smollm2_dir, tiny_gemma3_dir, tiny_llama3_dir,
                                   tiny_llama_dir, tiny_llama_long_dir, tiny_mistral_dir,
                                   tiny_phi3_dir, tiny_qwen2_dir, tiny_qwen3_dir,
                                   tiny_qwen3_moe_dir, tiny_mixtral_dir, tiny_gpt_oss_dir)
from tests.fixtures.fallback_models import (tiny_granite_dir,  # noqa: E402,F401
                                            tiny_olmo2_dir)
from tests.fixtures.cluster import ray_session, tiny_cluster  # noqa: E402,F401
from tests.fixtures.adapters import adapter_factory, tiny_adapters  # noqa: E402,F401


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``bash run.sh test`` runs two workers, ``--dist loadgroup``), every
    test of the session's one Ray runs on one worker, in order: Ray is started once per test
    session, and its clusters' start-ups, drains and timeouts leave a core idle that the other
    worker's tests use."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
