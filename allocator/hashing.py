"""Prefix block hashing: the one function the router and the worker both use (docs/design.md §2).

A prompt's full blocks of ``block_size`` tokens are hashed as a chain::

    root = H(identity, tenant, cache_salt)
    h[i] = H(h[i-1], tokens of block i as little-endian int32)

Every component is tagged with its kind and length before hashing, so no two different
tuples can produce the same bytes (an adapter named "x" with no salt never collides with
no adapter and salt "x"). ``H`` is sha256 truncated to 128 bits.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import Sequence

HASH_BYTES = 16  # sha256 truncated to 128 bits


def _field(kind: bytes, payload: bytes) -> bytes:
    """Length-prefixed, kind-tagged encoding of one hash input component."""
    return struct.pack("<I", len(kind)) + kind + struct.pack("<Q", len(payload)) + payload


def _h(*parts: bytes) -> bytes:
    return hashlib.sha256(b"".join(parts)).digest()[:HASH_BYTES]


@dataclass(frozen=True)
class CacheIdentity:
    """Everything that changes what a KV block holds, apart from tenant and salt.

    Fingerprints are hex digests computed by :mod:`kvfleet.allocator.fingerprint` from the
    model directory, so router and worker derive identical values from the same files.
    """

    model: str
    weights_fingerprint: str
    tokenizer_fingerprint: str
    chat_template_fingerprint: str
    kv_dtype: str
    block_size: int
    adapter: str = ""
    adapter_revision: str = ""

    def digest(self) -> bytes:
        """sha256/128 of the canonical JSON of all fields (sorted keys, no whitespace).

        Computed once per instance (the router needs it for every request)."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
            cached = _h(_field(b"identity", canonical.encode()))
            object.__setattr__(self, "_digest", cached)  # frozen: not a field, not compared
        return cached

    def with_adapter(self, adapter: str, revision: str = "") -> "CacheIdentity":
        """The same identity with a LoRA adapter (name + revision) applied."""
        d = asdict(self)
        d.update(adapter=adapter, adapter_revision=revision)
        return CacheIdentity(**d)


def root_hash(identity_digest: bytes, tenant: str, cache_salt: str = "") -> bytes:
    """Root of a request's block-hash chain: H(identity, tenant, cache_salt), each tagged."""
    return _h(
        _field(b"identity", identity_digest),
        _field(b"tenant", tenant.encode()),
        _field(b"cache_salt", cache_salt.encode()),
    )


def hash_block(parent: bytes, block_token_ids: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash (tokens as little-endian int32)."""
    tokens = struct.pack(f"<{len(block_token_ids)}i", *block_token_ids)
    return _h(_field(b"parent", parent), _field(b"tokens", tokens))


def block_hash_chain(
    root: bytes, token_ids: Sequence[int], block_size: int, start: Sequence[bytes] = ()
) -> list[bytes]:
    """Chain hashes of every *full* block of ``token_ids`` (a partial tail is not hashed).

    ``start`` may hold the already-computed hashes of the leading blocks, so that a growing
    sequence is hashed incrementally. Returns ``len(token_ids) // block_size`` hashes.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    chain = list(start)
    parent = chain[-1] if chain else root
    first, end = len(chain), len(token_ids) // block_size
    if first >= end:
        return chain
    # Same bytes as hash_block, built once per chain (the router hashes every prompt): pack
    # all tokens in one call, slice per block, reuse the constant tag/length headers.
    packed = struct.pack(f"<{(end - first) * block_size}i",
                         *token_ids[first * block_size : end * block_size])
    width = 4 * block_size
    parent_head = _field(b"parent", b"")[:-8] + struct.pack("<Q", HASH_BYTES)
    tokens_head = _field(b"tokens", b"")[:-8] + struct.pack("<Q", width)
    sha256 = hashlib.sha256
    for j in range(end - first):
        if len(parent) != HASH_BYTES:  # a caller-supplied root of another length
            i = first + j
            parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        else:
            parent = sha256(parent_head + parent + tokens_head
                            + packed[j * width:(j + 1) * width]).digest()[:HASH_BYTES]
        chain.append(parent)
    return chain
