"""LoRA adapters served by the real engine against transformers + peft (unmerged), fp32,
logits within 1e-4 x max(1, max|ref|) (``scaled_error <= 1``).

Three seeded adapters of different ranks and targets (``tests/fixtures/adapters.py``): every
test first sees each adapter move the logits by >= 100x the tolerance, so a no-op adapter
cannot pass. Two negative controls must fail: slot indices shifted by one within a batch, and
the alpha / r scale dropped.
"""

from __future__ import annotations

import math

import pytest

import kvfleet.worker.runner.lora.config as lora_config
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from tests.fixtures.adapters import ADAPTERS, peft_logits
from tests.unit.worker.engine_harness import prompt, request, run
from tests.unit.worker.lora_harness import lora_error, make_lora_engine, preload, with_adapter
from tests.unit.worker.paged_driver import scaled_error

THREE = ("qv", "all", "rs")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tiny_adapters):
    """The adapter dirs, after checking each moves the logits far beyond the tolerance."""
    tokens = prompt(12, seed=70)
    base = peft_logits(tiny_llama_dir, None, tokens)
    for name in (*THREE, "qv2"):
        moved = scaled_error(dict(enumerate(base)), peft_logits(tiny_llama_dir, tiny_adapters[name], tokens))
        assert moved >= 100, f"adapter {name} moves the logits by only {moved:.1f}x the tolerance"
    return tiny_adapters


@pytest.fixture(scope="module")
def family_adapter(tiny_llama_dir, adapters, adapter_factory):
    """``get(model_dir, name)``: the adapter's directory for that checkpoint (the tiny Llama's
    from ``adapters``), checked to move its logits far beyond the tolerance."""
    def get(model_dir, name):
        if model_dir == tiny_llama_dir:
            return adapters[name]
        adapter = adapter_factory(model_dir, name)
        tokens = prompt(12, seed=70)
        moved = scaled_error(dict(enumerate(peft_logits(model_dir, None, tokens))),
                             peft_logits(model_dir, adapter, tokens))
        assert moved >= 100, f"{name} moves the logits by only {moved:.1f}x the tolerance"
        return adapter
    return get


# The three adapters on Llama; on Qwen3 (qk-norm) and Gemma 3 (GeGLU, four norms), "all":
# every attention and MLP projection; on Qwen3-MoE "attn", every attention projection (an
# adapter on its experts is refused: tests/unit/worker/runner/test_moe.py).
EACH = [*(("tiny_llama_dir", n) for n in THREE), ("tiny_qwen3_dir", "all"),
        ("tiny_gemma3_dir", "all"), ("tiny_qwen3_moe_dir", "attn")]


@pytest.mark.parametrize("model_dir, name", EACH, indirect=["model_dir"])
def test_each_adapter_token_by_token_and_chunked(model_dir, family_adapter, name) -> None:
    adapter = family_adapter(model_dir, name)
    one = with_adapter(request(prompt(9, seed=71), max_tokens=5), name)
    chunked = with_adapter(request(prompt(23, seed=72), max_tokens=4), name)
    widths = [5, 7, 3, 8]  # the step budgets once the adapter has loaded (it loads first)
    for req, budget in ((one, lambda n: 1), (chunked, lambda n: widths[n] if n < 4 else 64)):
        engine, rec, _ = make_lora_engine(model_dir, {name: adapter})
        res = run(engine, [req], budgets=lambda k: budget(len(rec.plans)))[(req.request_id, 0)]
        assert len(res.token_ids) == req.params.max_tokens
        assert {c.adapter_slot for p in rec.plans for c in p.chunks} == {1}
        err = lora_error(model_dir, adapter, rec, req, res)
        assert err <= 1, f"{name}: {err:.2f}x the tolerance"
    assert [len(p.chunks[0].token_ids) for p in rec.plans][:4] == widths


def _mixed(tiny_llama_dir, adapters, wrap=None):
    """Three adapters + base, two requests each, joining and leaving at different steps."""
    names = [*THREE, ""] * 2
    lengths = [(5, 9), (23, 4), (14, 7), (3, 7), (17, 5), (9, 6), (11, 3), (6, 8)]
    reqs = [with_adapter(request(prompt(p, seed=80 + i), max_tokens=m), names[i])
            for i, (p, m) in enumerate(lengths)]
    engine, rec, residency = make_lora_engine(tiny_llama_dir, {n: adapters[n] for n in THREE},
                                              wrap=wrap, max_num_batched_tokens=20)
    preload(residency, THREE)  # every request joins at its step, however long loads take
    results = run(engine, {0: reqs[:3], 1: [reqs[3]], 3: reqs[4:6], 6: reqs[6:]})
    errors = {r.request_id: lora_error(tiny_llama_dir, adapters[r.adapter] if r.adapter else None,
                                       rec, r, results[(r.request_id, 0)]) for r in reqs}
    return rec, errors


def test_mixed_batch_of_three_adapters_and_base_equals_each_alone(tiny_llama_dir, adapters) -> None:
    rec, errors = _mixed(tiny_llama_dir, adapters)
    assert max(len({c.adapter_slot for c in p.chunks}) for p in rec.plans) == 4, \
        "some step must mix all three adapters and the base model"
    assert any(len({len(c.token_ids) > 1 for c in p.chunks}) == 2 for p in rec.plans)
    assert max(errors.values()) <= 1, errors


class ShiftedSlots:
    """Negative control: each chunk gets the next chunk's adapter slot (rotated by one)."""

    pausable = False  # whole steps only: no execute_pausable

    def __init__(self, runner) -> None:
        self.runner, self.config = runner, runner.config
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size

    def execute(self, plan: StepPlan):
        slots = [c.adapter_slot for c in plan.chunks]
        slots = slots[1:] + slots[:1]
        chunks = tuple(SeqChunk(c.seq_id, c.token_ids, c.num_computed_tokens, c.block_table, s)
                       for c, s in zip(plan.chunks, slots))
        return self.runner.execute(StepPlan(chunks, plan.block_copies))


def test_negative_control_shifted_slots_fail(tiny_llama_dir, adapters) -> None:
    _, errors = _mixed(tiny_llama_dir, adapters, wrap=ShiftedSlots)
    assert max(errors.values()) > 100, errors


def test_negative_control_dropped_scaling_fails(tiny_llama_dir, adapters, monkeypatch) -> None:
    monkeypatch.setattr(lora_config, "scaling", lambda alpha, rank, rslora: 1.0)
    req = with_adapter(request(prompt(10, seed=90), max_tokens=3), "all")
    engine, rec, _ = make_lora_engine(tiny_llama_dir, {"all": adapters["all"]})
    res = run(engine, [req])[(req.request_id, 0)]
    assert lora_error(tiny_llama_dir, adapters["all"], rec, req, res) > 100


def test_rslora_scales_by_alpha_over_sqrt_r(tiny_llama_dir, adapters) -> None:
    _, _, residency = make_lora_engine(tiny_llama_dir, {"rs": adapters["rs"]})
    cfg = ADAPTERS["rs"]
    scales = {t.scale for t in residency.spec("rs").config.targets}
    assert scales == {cfg["lora_alpha"] / math.sqrt(cfg["r"])}
    assert {t.layer for t in residency.spec("rs").config.targets} == {0, 2}
    # alpha / r would be 2.0: that it matches peft is test_each_adapter's "rs" case.
    assert lora_config.scaling(4, 2, use_rslora=False) == 2.0


def test_prefix_hit_only_under_the_same_adapter_revision(tiny_llama_dir, adapters) -> None:
    """A prompt cached under adapter qv hits again under qv, never under another adapter, the
    base model, or a new revision of qv (same name, new weights), and each is exact."""
    from kvfleet.worker.runner.lora.adapter import check_adapter

    engine, rec, residency = make_lora_engine(tiny_llama_dir, {n: adapters[n] for n in THREE})
    shared = prompt(18, seed=91)
    first = with_adapter(request(shared, max_tokens=2), "qv")
    again = with_adapter(request(shared, max_tokens=3), "qv")
    other = with_adapter(request(shared, max_tokens=3), "all")
    base = request(shared, max_tokens=3)
    results = run(engine, {0: [first], 6: [again], 12: [other], 18: [base]})
    cached = {r.request_id: results[(r.request_id, 0)].last.usage.cached_prompt_tokens
              for r in (first, again, other, base)}
    assert cached == {first.request_id: 0, again.request_id: 16, other.request_id: 0,
                      base.request_id: 0}
    old_revision = residency.spec("qv").revision
    residency.register(check_adapter("qv", adapters["qv2"], engine.executor.config, 16))
    assert residency.spec("qv").revision != old_revision
    reloaded = with_adapter(request(shared, max_tokens=3), "qv")
    res = run(engine, [reloaded])[(reloaded.request_id, 0)]
    assert res.last.usage.cached_prompt_tokens == 0
    for r, d in ((again, adapters["qv"]), (other, adapters["all"]), (base, None)):
        assert lora_error(tiny_llama_dir, d, rec, r, results[(r.request_id, 0)]) <= 1
    assert lora_error(tiny_llama_dir, adapters["qv2"], rec, reloaded, res) <= 1
