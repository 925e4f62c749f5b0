"""Where a rank's quantized weights come from: the checkpoint's float tensors quantized at load
(round-to-nearest), a GGUF beside them read as it is, or a GPTQ/AWQ checkpoint repacked.

:func:`load_rank_weights` returns HF-named tensors like
:func:`~kvfleet.worker.runner.tp.shard_weights.load_shard_weights`, with every quantizable
weight (:func:`quantizable`: the decoder layers' projections, the embedding, the LM head) a
:class:`~.tensor.QuantTensor` when the replica serves quantized weights. Norms and biases stay
float. Which source served which tensor, and any re-quantization, is logged.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from kvfleet.worker.runner.models import PROJECTIONS
from kvfleet.worker.runner.quant import checkpoint, gguf_source
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.packed import QuantLayoutError, quantize
from kvfleet.worker.runner.quant.tensor import QuantTensor
from kvfleet.worker.runner.tp.layout import ShardLayout
from kvfleet.worker.runner.tp.shard_weights import load_shard_weights

log = logging.getLogger(__name__)

_LAYER_WEIGHT = re.compile(r"^model\.layers\.\d+\.[A-Za-z_]+\.([A-Za-z_]+)\.weight$")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def quantizable(name: str) -> bool:
    """Whether HF tensor ``name`` is held quantized: the embedding, the LM head, and each
    decoder layer's projection weights (the modules :data:`~..models.PROJECTIONS` fuses)."""
    if name in _TABLES:
        return True
    match = _LAYER_WEIGHT.match(name)
    return match is not None and any(match.group(1) in mods for mods in PROJECTIONS.values())


def load_rank_weights(model_dir: str | Path, layout: ShardLayout, dtype: torch.dtype,
                      quant: QuantConfig) -> dict[str, torch.Tensor]:
    """This rank's tensors by HF name, quantized per ``quant`` (see the module docstring).

    Raises:
        UnsupportedModel: a quantized checkpoint of a format other than GPTQ / AWQ (named).
        QuantLayoutError: a group size that does not tile a weight, or a tensor-parallel split
            that cuts a group (the message names the tensor and the sizes).
        FileNotFoundError, ValueError: see ``load_shard_weights``.
    """
    quantized = checkpoint.read_format(model_dir)
    if quantized is not None:
        weights, packed = checkpoint.load(model_dir, quantized, layout, dtype, quant)
    else:
        weights = load_shard_weights(model_dir, layout, dtype)
        packed = {}
        if quant.bits is not None:
            packed = gguf_source.native_weights(model_dir, layout, quant.bits, weights)
    if quant.bits is None:
        return weights
    held: dict[str, torch.Tensor] = {name: QuantTensor(p, dtype) for name, p in packed.items()}
    held.update((name, _held(name, t, layout, quant, dtype))
                for name, t in weights.items() if name not in held)
    return held


def _held(name: str, tensor: torch.Tensor, layout: ShardLayout, quant: QuantConfig,
          dtype: torch.dtype) -> torch.Tensor:
    if not quantizable(name):
        return tensor
    assert quant.bits is not None
    try:
        return QuantTensor(quantize(tensor, quant.bits, quant.group_size), dtype)
    except QuantLayoutError as exc:
        split = f" (this rank's share at tp={layout.tp})" if layout.tp > 1 else ""
        raise QuantLayoutError(f"{name}{split}: {exc}") from None
