"""``Worker.ExportBlocks``: a peer asks this replica for blocks of a prefix (docs/kv_tier.md,
"Peer pull"); and the same call in process (:class:`InProcessPeer`).

The proto request is checked here; the engine loop references the blocks, writes them back to
the node's host tier with its next step and waits for rank 0's put
(:meth:`~kvfleet.worker.service.engine_loop.EngineLoop.export_blocks`).
"""

from __future__ import annotations

import asyncio
import math
from typing import Sequence

from kvfleet.allocator.hashing import HASH_BYTES
from kvfleet.errors import DeadlineExceeded, InvalidArgument
from kvfleet.v1 import worker_pb2
from kvfleet.worker.kv_tier.peer_pull import Exported, PeerHint
from kvfleet.worker.service.engine_loop import EngineLoop

DEFAULT_TIMEOUT_S = 5.0
MAX_EXPORT_BLOCKS = 4096  # 65,536 tokens of 16: more than any context this serves
MAX_EXPORT_TIMEOUT_S = 60.0  # a pull waits 5 s at most; a caller without a deadline no more


def export_hashes(request: worker_pb2.ExportBlocksRequest) -> tuple[bytes, ...]:
    """The request's hashes, checked.

    Raises:
        InvalidArgument: none, too many, one not ``HASH_BYTES`` long, a repeated one (no
            chain repeats a hash), or a ``timeout_s`` negative or not finite (names the field).
    """
    hashes = tuple(request.block_hashes)
    if not hashes or len(hashes) > MAX_EXPORT_BLOCKS:
        raise InvalidArgument(f"block_hashes must hold 1..{MAX_EXPORT_BLOCKS} hashes, got "
                              f"{len(hashes)}", field="block_hashes")
    bad = next((i for i, h in enumerate(hashes) if len(h) != HASH_BYTES), None)
    if bad is not None:
        raise InvalidArgument(f"block_hashes[{bad}] is {len(hashes[bad])} bytes, not {HASH_BYTES}",
                              field="block_hashes")
    if len(set(hashes)) != len(hashes):
        raise InvalidArgument("block_hashes repeats a hash: not a chain", field="block_hashes")
    # inf or NaN would reach the write-back wait (threading: OverflowError / ValueError).
    if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
        raise InvalidArgument(f"timeout_s must be finite and >= 0, got {request.timeout_s}",
                              field="timeout_s")
    return hashes


async def export_blocks(loop: EngineLoop, request: worker_pb2.ExportBlocksRequest,
                        node_id: str, time_remaining: float | None
                        ) -> worker_pb2.ExportBlocksResponse:
    """Export what this replica holds of ``request``'s blocks; ``time_remaining``: the call's
    gRPC deadline (None: none). The wait is at most ``MAX_EXPORT_TIMEOUT_S``.

    Raises:
        InvalidArgument: a malformed request. FailedPrecondition: no host tier.
        DeadlineExceeded: the blocks were not in the tier within the timeout.
    """
    hashes = export_hashes(request)
    timeout_s = min(request.timeout_s or time_remaining or DEFAULT_TIMEOUT_S,
                    MAX_EXPORT_TIMEOUT_S)
    try:
        exported = await loop.export_blocks(hashes, timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise DeadlineExceeded(f"export of {len(hashes)} blocks not done in {timeout_s:.3f} s"
                               ) from exc
    return worker_pb2.ExportBlocksResponse(block_hashes=list(exported), node_id=node_id)


class InProcessPeer:
    """A :class:`~kvfleet.worker.kv_tier.peer_pull.PeerClient` over a peer's engine loop in this
    process: what its ``ExportBlocks`` handler does, without the gRPC hop (tests, benchmarks).
    ``node_id``: the node it reports (the tier the blocks went to)."""

    def __init__(self, loop: EngineLoop, node_id: str = "") -> None:
        self.loop, self.node_id = loop, node_id

    async def export(self, hint: PeerHint, hashes: Sequence[bytes], timeout_s: float) -> Exported:
        return Exported(await self.loop.export_blocks(tuple(hashes), timeout_s), self.node_id)

    async def close(self) -> None:
        """Nothing to release."""
