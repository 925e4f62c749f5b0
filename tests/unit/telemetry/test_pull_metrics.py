"""Issue 26 §2: a replica's peer-pull counters (``PullStats``) exported as metrics, read from a
real :class:`PeerPuller` driven through a pull that lands, one refused, one answered empty, one
failed, one timed out and one skipped (in process: the peers are stand-ins, nothing is computed)."""

from __future__ import annotations

import asyncio

from kvfleet.allocator.hashing import block_hash_chain, root_hash
from kvfleet.telemetry import names as n
from kvfleet.telemetry.worker_spans import WorkerTelemetry
from kvfleet.worker.kv_tier.peer_pull import Exported, PeerHint, PeerPuller, PullCost
from tests.unit.worker.engine_harness import BLOCK_SIZE, prompt, request
from tests.unit.worker.kv_tier.peer_harness import SLOW_PREFILL

IDENTITY = b"i" * 16


class _Peer:
    """Answers every export with ``answer(hashes)``, or raises ``error``."""

    def __init__(self, answer=lambda h: h, error: Exception | None = None) -> None:
        self.answer, self.error = answer, error

    async def export(self, hint, hashes, timeout_s) -> Exported:
        if self.error is not None:
            raise self.error
        return Exported(tuple(self.answer(tuple(hashes))), "")

    async def close(self) -> None:
        """Nothing to release."""


def test_pull_counters_are_exported(worker_capture) -> None:
    peer = _Peer()
    puller = PeerPuller(peer, SLOW_PREFILL, IDENTITY, BLOCK_SIZE, 64, PullCost(1 << 10))
    holder: list = []
    WorkerTelemetry(worker_capture.telemetry, "r1", "tiny",
                    pull_stats_fn=lambda: holder[0] if holder else None)
    assert worker_capture.points(n.METRIC_PEER_PULLS) == []  # no puller yet: nothing reported
    holder.append(puller.stats)

    req = request(prompt(4 * BLOCK_SIZE + 1, seed=5), max_tokens=1)
    hint = PeerHint("a", "in-process", num_blocks=4)
    chain = block_hash_chain(root_hash(IDENTITY, req.tenant), list(req.prompt_token_ids),
                             BLOCK_SIZE)

    async def drive() -> None:
        await puller.prepare(req, hint)                       # lands: 4 blocks
        peer.answer = lambda h: h[1:]                         # not a leading run: refused
        assert (await puller.prepare(req, hint)).tier_skip
        peer.answer = lambda h: ()                            # the peer no longer holds them
        await puller.prepare(req, hint)
        peer.error = RuntimeError("peer gone")                # failed
        await puller.prepare(req, hint)
        peer.error = TimeoutError("holder mid-step")          # failed: timed out
        await puller.prepare(req, hint)
        await puller.prepare(req, PeerHint("a", "x", num_blocks=4, first_block=4))  # skipped

    asyncio.run(drive())
    assert puller.stats.pulled_blocks == 4 == len(chain[:4])

    def value(metric: str) -> float:
        (point,) = worker_capture.points(metric)
        assert point.attributes[n.GEN_AI_REQUEST_MODEL] == "tiny"
        return point.value

    assert value(n.METRIC_PEER_PULLS) == 1
    assert value(n.METRIC_PEER_PULLED_BLOCKS) == 4
    assert value(n.METRIC_PEER_PULL_TIME) == puller.stats.pull_s > 0
    assert value(n.METRIC_PEER_PULLS_REFUSED) == 1
    assert value(n.METRIC_PEER_PULLS_FAILED) == 2
    assert value(n.METRIC_PEER_PULLS_TIMED_OUT) == 1
    assert value(n.METRIC_PEER_PULLS_EMPTY) == 1
    assert value(n.METRIC_PEER_PULLS_SKIPPED) == 1
