"""A replica built from its config (``build_engine``, no Ray) on a model with no native family:
``model_impl`` ``auto`` picks the transformers fallback, start-up calibration runs on it, and
greedy tokens equal transformers' own ``generate``."""

from __future__ import annotations

import torch

from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.replica.replica import ReplicaConfig, build_engine
from tests.unit.worker.paged_driver import hf_model, random_prompt


def test_auto_serves_granite_through_the_fallback(tiny_granite_dir, tmp_path) -> None:
    cfg = ReplicaConfig(replica_id="g", model_name="granite", model_dir=str(tiny_granite_dir),
                        block_size=4, num_blocks=64, max_loras=1, step_cost_dir=str(tmp_path),
                        calibration_budget_s=0.5)
    assert cfg.model_impl == "auto"
    engine = build_engine(cfg)
    assert engine.executor.config.impl == "transformers"
    prompts = [random_prompt(n, seed=n) for n in (9, 14)]
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", tuple(p),
                                         SamplingParams(max_tokens=6, ignore_eos=True)))
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += list(out.token_ids)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf_model(tiny_granite_dir).generate(torch.tensor([p]), max_new_tokens=6,
                                                       do_sample=False)[0, len(p):].tolist()
        assert tokens[f"r{i}"] == want
