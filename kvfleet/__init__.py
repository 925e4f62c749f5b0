"""kvfleet: an LLM inference serving cluster.

The subpackages live in the repository's top-level folders, mapped by setuptools
``package-dir``: ``kvfleet.router`` is ``router/`` (gRPC and HTTP edges, prefix-aware routing),
``kvfleet.worker`` is ``worker/`` (replicas: ``service/``, ``engine/``, ``runner/``,
``executor/``, ``replica/``), ``kvfleet.allocator`` is ``allocator/`` (KV-cache bookkeeping both
sides import) and ``kvfleet.deploy`` is ``deploy/`` (CLI, launcher, Serve and Kubernetes).
This folder, ``kvfleet/``, holds what router and worker share: the client, errors, sampling
parameters, the Redis key layout, TLS, stream limits, ``telemetry/`` and ``v1/`` (the gRPC stubs
generated from ``proto/``). Design: ``docs/design.md``.
"""

__version__ = "0.1.0"
