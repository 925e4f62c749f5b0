"""kvfleet: an LLM inference serving cluster.

Subpackages follow the request's path: ``kvfleet.router`` (gRPC entry, prefix-aware routing)
→ ``kvfleet.worker`` (scheduler, model runner, stream) with ``kvfleet.allocator`` (KV-cache
bookkeeping shared by both); ``kvfleet.v1`` holds the generated gRPC stubs and
``kvfleet.deploy`` the CLI and local launcher.
"""

__version__ = "0.1.0"
