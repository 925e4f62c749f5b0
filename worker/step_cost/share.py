"""Replica-seconds per request: each step's measured forward seconds shared among its rows.

The engine measures one forward's seconds for the whole step; a request's share of them is
what it cost the replica, the unit in which one class's loss and another's consumption
compare (docs/slo.md, "Replica-seconds per request"). The rule, with the terms of
:mod:`kvfleet.worker.step_cost.model`:

* a chunk's **own terms** are its rows' modelled seconds: a decode row (``decode_token_s``)
  and its drafts (``draft_token_s`` each), or a prefill chunk's tokens (``prefill_token_s``
  each), plus the KV positions it attends (``context_token_s`` × :func:`attended`);
* the step's **measured** seconds are shared pro rata to the own terms, so the step's fixed
  terms (``step_base_s``, ``gemm_step_s``) and whatever the model misses fall on its rows in
  the same proportion; a step of one row charges that row all of it;
* a layer-yield nested step is a step of its own: its rows are charged its seconds, and the
  paused step its own seconds without the nested ones (the engine measures them apart).

So the shares of a step sum to its measured seconds, and a replica's requests together to
its forward seconds. Torch-free arithmetic.
"""

from __future__ import annotations

from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.step_cost.model import CostModel, attended


def row_cost_s(cost: CostModel, chunk: SeqChunk) -> float:
    """Modelled seconds ``chunk``'s own terms add to a step under ``cost`` (its rows and the
    positions they attend; not the step's fixed terms). A one-token chunk or a chunk with
    drafts is a decode row and its drafts, as :func:`~.model.plan_shape` counts it."""
    n = len(chunk.token_ids)
    if n == 1 or chunk.num_draft_tokens:
        rows = cost.decode_token_s + cost.draft_token_s * (n - 1)
    else:
        rows = cost.prefill_token_s * n
    return rows + cost.context_token_s * attended(chunk.num_computed_tokens, n)


def share_step_s(cost: CostModel, plan: StepPlan, seconds: float) -> list[float]:
    """``seconds`` of ``plan``'s forward shared among its chunks pro rata to
    :func:`row_cost_s` (equally where every chunk's terms are 0, e.g. a zero cost model).

    Returns:
        ``(len(plan.chunks),)`` seconds, in chunk order, summing to ``seconds`` (up to float
        rounding; empty for an empty plan).
    """
    costs = [row_cost_s(cost, c) for c in plan.chunks]
    total = sum(costs)
    if total <= 0:
        return [seconds / len(costs)] * len(costs) if costs else []
    return [seconds * c / total for c in costs]
