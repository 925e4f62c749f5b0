"""TP and LoRA as layers around a plain model's projections: what wraps what, in which order,
and that a LoRA update is summed over the ranks with its projection's partial product."""

from __future__ import annotations

import torch

from kvfleet.worker.runner.lora.layer import AdapterMapping, LoraLinear, apply_lora
from kvfleet.worker.runner.lora.slots import LoraBatch, LoraSlots
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.models import PROJECTIONS
from kvfleet.worker.runner.models.linear import Linear
from kvfleet.worker.runner.tp.layout import shard_layout
from kvfleet.worker.runner.tp.linear import RowParallelLinear, parallelize, row_parallel


def test_lora_update_joins_the_partial_sum_before_the_all_reduce() -> None:
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g),
               torch.randn(2, 4, generator=g))
    slots = LoraSlots(1)
    slots.install(1, {(3, "o"): (a, b)})
    mapping = AdapterMapping()
    reduced: list[torch.Tensor] = []

    def reduce(t: torch.Tensor) -> torch.Tensor:  # two ranks holding the same partial sum
        reduced.append(t.clone())
        return t.mul_(2)

    proj = RowParallelLinear(LoraLinear(Linear(w), 3, "o", mapping), reduce)
    x = torch.randn(3, 6, generator=g)
    with mapping.step(LoraBatch.build(slots, [0, 1], [1, 2], torch.device("cpu"))):
        y = proj(x)
    want = x @ w
    want[1:] += x[1:] @ a @ b  # rows 1-2 run the adapter, row 0 the base model
    torch.testing.assert_close(reduced[0], want)
    torch.testing.assert_close(y, 2 * want)
    assert mapping.batch is None  # dropped after the step
    torch.testing.assert_close(proj(x), 2 * (x @ w))  # outside a step: the base projection


def test_runner_wraps_only_what_the_configuration_needs(tiny_llama_dir) -> None:
    """No adapter slots and one rank: the built model's plain projections, untouched. Slots:
    every projection reads the step's adapters. A second rank: O and down also all-reduce,
    around their LoRA layer. The bytes counted stay the base weights'."""
    plain = ModelRunner(tiny_llama_dir, 8, 4, one_row_weights=False)
    assert all(type(p) is Linear for p in plain.model.projections())
    lora = ModelRunner(tiny_llama_dir, 8, 4, one_row_weights=False, max_loras=2)
    layer = lora.model.layers[1]
    holders = layer.projection_holders()
    assert set(holders) == set(PROJECTIONS) and holders["down"] is layer.mlp

    def wrapped(name):
        return getattr(holders[name], name)

    assert {type(wrapped(n)) for n in PROJECTIONS} == {LoraLinear}
    assert (layer.o.layer, layer.o.group) == (1, "o")
    assert lora.weight_nbytes() == plain.weight_nbytes()
    assert [n for n in PROJECTIONS if row_parallel(n)] == ["o", "down"]

    parallelize(lora.model, shard_layout(lora.config, 1, 0), lambda t: t)
    assert {type(wrapped(n)) for n in PROJECTIONS} == {LoraLinear}  # tp=1: nothing to sum
    parallelize(lora.model, shard_layout(lora.config, 2, 0), lambda t: t)
    for name in PROJECTIONS:
        p = wrapped(name)
        if name in ("o", "down"):
            assert type(p) is RowParallelLinear and type(p.local) is LoraLinear
        else:
            assert type(p) is LoraLinear
    assert lora.weight_nbytes() == plain.weight_nbytes()


def test_apply_lora_without_slots_wraps_nothing(tiny_llama_dir) -> None:
    runner = ModelRunner(tiny_llama_dir, 8, 4, one_row_weights=False)
    before = runner.model.projections()
    assert apply_lora(runner.model, 0).batch is None
    assert runner.model.projections() == before
