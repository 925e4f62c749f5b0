"""Shared fixtures live in tests/fixtures/, one module per real component."""

from hypothesis import settings

# Tests are never timed.
settings.register_profile("kvfleet", deadline=None, max_examples=100)
settings.load_profile("kvfleet")

from tests.fixtures.redis import redis_namespace, redis_server  # noqa: E402,F401
from tests.fixtures.models import (llama_8q2kv_dir, llama_8q4kv_dir,  # noqa: E402,F401
                                   smollm2_dir, tiny_llama_dir, tiny_llama_long_dir,
                                   tiny_mistral_dir, tiny_qwen2_dir)
from tests.fixtures.cluster import ray_session, tiny_cluster  # noqa: E402,F401
from tests.fixtures.adapters import tiny_adapters  # noqa: E402,F401
