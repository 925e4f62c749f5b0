"""The step-cost constants measured once on the reference set-up (the default model, fp32, one
torch thread, the development machine; ``python -m bench calibrate`` writes the samples), as
plain numbers both sides read: a replica's step-cost model starts from them before its own
start-up calibration, the cost-model executor sleeps by them
(kvfleet.worker.step_cost.model.MEASURED), and the router derives its default host-hit weight
from them (kvfleet.router.tier_credit). The linear form they belong to:
kvfleet.worker.step_cost.model."""

from typing import NamedTuple


class StepCosts(NamedTuple):
    """Seconds per step, per prefill token, per decode row; where they were measured. The
    leading fields of ``CostModel``, in its order."""

    step_base_s: float
    prefill_token_s: float
    decode_token_s: float
    source: str


MEASURED_STEP_COSTS = StepCosts(
    0.319826, 0.0125125, 0.0881751,
    "SmolLM2-135M-Instruct fp32, 1 torch thread(s), vm (2 CPUs), 2026-11-30")
