"""Tensor parallelism for a Hugging Face model class, from its ``base_model_tp_plan``.

The plan maps module patterns (``layers.*.self_attn.q_proj``) to a style; each matching
``nn.Linear`` keeps this rank's share of its weight and gains hooks that sum over the ranks
with the group's one in-place all-reduce (the native path's primitive):

* ``colwise``: rows ``r·out/T ..`` of the ``[out, in]`` weight (and bias): this rank's heads
  or MLP columns, no communication;
* ``rowwise``: columns ``r·in/T ..``; the partial outputs are summed (bias on rank 0 only);
* ``colwise_gather_output``: as ``colwise``, then the output is gathered to its whole width
  (each rank's columns placed in zeros, summed): for a norm over the whole projection (OLMo 2);
* ``rowwise_split_input``: as ``rowwise`` on a replicated input, sliced to this rank's columns.

Any other style, a plan entry naming a module that is not a linear, or a model without a plan
is refused when the replica starts (:func:`check_plan`). The embedding, norms and LM head stay
whole on every rank (the LM head is used by rank 0 only, as on the native path).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from kvfleet.allocator.kv_bytes import ShardingError
from kvfleet.worker.runner.model_config import ModelConfig, UnsupportedModel

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def check_plan(plan: Mapping[str, str] | None, config: ModelConfig, tp: int) -> None:
    """Refuse a ``tp`` the plan cannot give (torch-free).

    Raises:
        UnsupportedModel: no plan, or a style other than :data:`STYLES` (the entry named).
        ShardingError: query or KV heads that do not split over ``tp``.
    """
    if tp == 1:
        return
    if not plan:
        raise UnsupportedModel(f"base_model_tp_plan: {config.architecture} declares none, so "
                               f"--model-impl transformers runs it at --tp 1 only")
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UnsupportedModel(f"base_model_tp_plan: {pattern!r}: {style!r} is not supported "
                                   f"by --model-impl transformers ({', '.join(STYLES)})")
    for field, heads in (("num_attention_heads", config.num_heads),
                         ("num_key_value_heads", config.num_kv_heads)):
        if heads % tp:
            raise ShardingError(field, f"{heads} heads do not split over tp={tp} (the "
                                       f"transformers implementation splits, never replicates)")


def local_kv_heads(plan: Mapping[str, str] | None, config: ModelConfig, tp: int) -> int:
    """KV heads one rank caches: split when the plan splits ``k_proj``'s output, else all."""
    split = any(p.rsplit(".", 1)[-1] == "k_proj" and s == "colwise" for p, s in (plan or {}).items())
    return config.num_kv_heads // tp if tp > 1 and split else config.num_kv_heads


def _matcher(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")


def shard_by_plan(base_model, plan: Mapping[str, str], tp: int, rank: int,
                  reduce: Callable) -> int:
    """Shard ``base_model``'s planned linears in place for ``rank`` of ``tp`` (see the module
    docstring); returns how many were sharded.

    Raises:
        UnsupportedModel: a planned module that is not an ``nn.Linear``.
        ShardingError: a split dimension not divisible by ``tp``.
    """
    import torch

    rules = [(_matcher(p), s) for p, s in plan.items()]
    count = 0
    for name, module in list(base_model.named_modules()):
        style = next((s for m, s in rules if m.match(name)), None)
        if style is None:
            continue
        if not isinstance(module, torch.nn.Linear):
            raise UnsupportedModel(f"base_model_tp_plan: {name} ({type(module).__name__}) is "
                                   f"not a linear layer")
        _shard_linear(name, module, style, tp, rank, reduce)
        count += 1
    return count


def _shard_linear(name: str, module, style: str, tp: int, rank: int, reduce: Callable) -> None:
    import torch

    column = style.startswith("colwise")
    dim = 0 if column else 1
    size = module.weight.shape[dim]
    if size % tp:
        raise ShardingError(name, f"{size} {'outputs' if column else 'inputs'} do not split "
                                  f"over tp={tp}")
    part = slice(rank * size // tp, (rank + 1) * size // tp)
    weight = module.weight.data[part] if column else module.weight.data[:, part]
    module.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    if module.bias is not None and (column or rank != 0):
        # colwise: this rank's outputs' bias; rowwise: rank 0 adds it once to the sum
        module.bias = (torch.nn.Parameter(module.bias.data[part].contiguous(), requires_grad=False)
                       if column else None)
    if style == "colwise_gather_output":
        def gather(mod, args, out):
            whole = out.new_zeros(*out.shape[:-1], size)
            whole[..., part] = out
            return reduce(whole)
        module.register_forward_hook(gather)
    elif not column:
        if style == "rowwise_split_input":
            module.register_forward_pre_hook(lambda mod, args: (args[0][..., part],))
        module.register_forward_hook(lambda mod, args, out: reduce(out.contiguous()))
