"""One tensor-parallel rank's share of a quantized weight held as codes + group scales.

The same rule as the float loader (:mod:`kvfleet.worker.runner.tp.shard_weights`): a
column-parallel projection keeps its rank's output rows, a row-parallel one its rank's input
columns — which must start and end on group boundaries, so every rank's groups are exactly
the whole weight's (a split that cuts a group is refused, naming the sizes).
"""

from __future__ import annotations

from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.quant.packed import Decoded, QuantLayoutError
from kvfleet.worker.runner.tp.layout import COLUMN, SPLITS, ShardLayout


def shard_decoded(name: str, decoded: Decoded, layout: ShardLayout) -> Decoded:
    """``(codes [out, in], scale, offset)`` of HF weight ``name`` → this rank's share.

    Raises:
        QuantLayoutError: a row-parallel split whose share does not start and end on a group
            boundary.
    """
    module = name.split(".")[-2] if ".layers." in name and name.endswith(".weight") else ""
    split = SPLITS.get(module)
    if layout.tp == 1 or split is None:
        return decoded
    codes, scale, offset = decoded
    span = layout.span(split.part)
    if split.axis == COLUMN:
        rows = slice(span.start, span.stop)
        return codes[rows], scale[rows], None if offset is None else offset[rows]
    group = codes.shape[1] // scale.shape[1]
    if span.start % group or len(span) % group:
        raise QuantLayoutError(
            f"{name}: tp={layout.tp} gives each rank {len(span)} of its {codes.shape[1]} inputs, "
            f"which does not split into its quantization groups of {group}")
    groups = slice(span.start // group, span.stop // group)
    return (codes[:, span.start:span.stop], scale[:, groups],
            None if offset is None else offset[:, groups])


def check_tp_groups(config_sizes: dict[str, int], group: int, tp: int) -> None:
    """Refuse ``tp`` before anything starts when a row-parallel input dimension
    (``config_sizes``: name → inputs, e.g. ``{"o_proj": 576, "down_proj": 1536}``) does not
    split into whole groups of ``group`` per rank.

    Raises:
        QuantLayoutError: names the projection, its inputs, tp and the group size.
    """
    for module, size in config_sizes.items():
        if size % tp or (size // tp) % group:
            raise QuantLayoutError(
                f"{module}: {size} inputs over tp={tp} give {size / tp:g} per rank, not a whole "
                f"number of quantization groups of {group} (--quant-group-size)")


def check_quant_groups(config: ModelConfig, group: int, tp: int, own_groups: bool = False) -> None:
    """Refuse ``--quant-group-size`` ``group`` before anything starts when it cannot tile a
    weight quantized at load: the inputs of every projection fed by the hidden state (and of
    the embedding and LM head), ``o_proj``'s and the dense MLP's ``down_proj``'s (per rank at
    ``tp``). ``own_groups``: a GPTQ/AWQ checkpoint, whose projections keep their own groups
    (only the hidden-size inputs are checked then).

    Raises:
        QuantLayoutError: names the weight, its inputs and the group size.
    """
    if config.hidden_size % group:
        raise QuantLayoutError(
            f"hidden_size: {config.hidden_size} inputs (the projections fed by the hidden state, "
            f"the embedding, the LM head) do not split into quantization groups of {group} "
            f"(--quant-group-size)")
    if own_groups:
        return
    sizes = {"o_proj": config.num_heads * config.head_dim}
    if config.moe is None:  # an expert's down_proj is held as the checkpoint has it
        sizes["down_proj"] = config.intermediate_size
    check_tp_groups(sizes, group, tp)
