"""What a host-tier hit is worth to the routing score, next to a device hit.

A block in a replica's node tier (``Candidate.host_blocks``: after its device prefix, up to
the tier's first miss) is not computed: admission restores it. It still costs the restore
(lookup, fetch through Ray's object store, copy into the pool), so it counts as
``host_hit_weight`` of a device hit:

    host_hit_weight = 1 − restore seconds per block ÷ prefill seconds per block

with the prefill side from the measured step costs (``MEASURED_STEP_COSTS.prefill_token_s`` ×
block size) and the restore side measured by ``python -m bench kv_tier`` on the same model and
machine: a single block's restore, the dearest case per block. On CPU the result is close to a
device hit; on GPUs prefill is far cheaper next to a host→device copy, so pass a lower
``host_hit_weight`` / ``--host-hit-weight`` there (the numbers: docs/kv_tier.md, "Credit").

``prefix_aware`` adds :func:`host_credit_blocks` to a replica's matched blocks;
``predicted_ttft`` takes :func:`host_credit_s` off its prefill seconds, so those blocks cost
their restore time (the remaining ``1 − host_hit_weight`` of their prefill) instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.measured_costs import MEASURED_STEP_COSTS

if TYPE_CHECKING:
    from kvfleet.router.policy import Candidate

RESTORE_BLOCK_S = 0.0107  # bench kv_tier: restore of one 16-token SmolLM2 block via the node actor
MEASURED_BLOCK_SIZE = 16


def host_hit_weight(restore_block_s: float, prefill_token_s: float, block_size: int) -> float:
    """``1 − restore ÷ prefill`` of one block, clamped to [0, 1] (module docstring).

    Raises:
        ValueError: a negative restore time, or a prefill time or block size not positive.
    """
    if restore_block_s < 0 or not prefill_token_s > 0 or block_size <= 0:
        raise ValueError(f"need restore_block_s >= 0, prefill_token_s > 0, block_size > 0; got "
                         f"{restore_block_s}, {prefill_token_s}, {block_size}")
    return min(1.0, max(0.0, 1.0 - restore_block_s / (prefill_token_s * block_size)))


DEFAULT_HOST_HIT_WEIGHT = round(
    host_hit_weight(RESTORE_BLOCK_S, MEASURED_STEP_COSTS.prefill_token_s, MEASURED_BLOCK_SIZE), 2)


def host_credit_blocks(c: "Candidate", weight: float) -> float:
    """Device-hit blocks ``c``'s host-tier hits are worth."""
    return weight * c.host_blocks


def host_credit_s(c: "Candidate", prefill_token_s: float, weight: float) -> float:
    """Prefill seconds ``c``'s host-tier hits save on a replica computing ``prefill_token_s``
    seconds per token (their restore still costs the rest)."""
    return weight * c.host_blocks * c.info.block_size * prefill_token_s
