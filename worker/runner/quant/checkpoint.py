"""Hugging Face checkpoints stored quantized: GPTQ and AWQ int4 (``qweight`` / ``qzeros`` /
``scales``), repacked without a float round trip, or dequantized when they cannot be.

``config.json``'s ``quantization_config.quant_method`` names the format; any other method is
refused at load, naming it. Layouts (int32 words, nibble ``i`` = bits ``4i .. 4i + 3``):

* GPTQ: ``qweight [in / 8, out]`` packs 8 consecutive inputs per word; ``qzeros [groups,
  out / 8]`` packs 8 consecutive outputs; ``scales [groups, out]``; ``w = scale · (q - z)``
  with ``z`` the stored zero + 1 (the original GPTQ format; ``checkpoint_format: gptq_v2``
  stores ``z`` itself). ``g_idx [in]``, when present, gives each input's group.
* AWQ (``version: gemm``): ``qweight [in, out / 8]`` and ``qzeros`` pack 8 outputs per word
  in the order 0 2 4 6 1 3 5 7; ``w = scale · (q - z)``.

As int4 groups: ``codes = q``, ``scale``, ``offset = -scale · z`` (exact in fp32). Weights
that cannot be held that way — inputs whose groups are not contiguous (GPTQ act-order), or a
replica not serving int4 — are dequantized to float (logged); the caller then quantizes them
as the replica asks. Only 4-bit checkpoints are read (other bits are refused).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from kvfleet.worker.runner.model_config import UnsupportedModel
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.packed import Decoded, PackedWeight, dequantize_decoded, pack_codes
from kvfleet.worker.runner.quant.shard import shard_decoded
from kvfleet.worker.runner.tp.layout import ShardLayout
from kvfleet.worker.runner.tp.shard_weights import shard_tensor
from kvfleet.worker.runner.weights import load_weights

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
# Formats whose tensors the float loader decodes itself (gpt-oss's MXFP4 experts, see
# kvfleet.worker.runner.mxfp4): the checkpoint is then read as a float one.
DEQUANTIZED_AT_LOAD = ("mxfp4",)
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8c + r sits in nibble _AWQ_ORDER[r] of word c
_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


def read_format(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config``, or None for a float checkpoint (or one whose
    format the float loader dequantizes: :data:`DEQUANTIZED_AT_LOAD`).

    Raises:
        UnsupportedModel: a method other than GPTQ / AWQ, or an AWQ version other than gemm.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method in DEQUANTIZED_AT_LOAD:
        return None
    if method not in METHODS:
        raise UnsupportedModel(f"quantization_config.quant_method {method!r} is not supported "
                               f"({', '.join(METHODS)})")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise UnsupportedModel(f"quantization_config.version {qc.get('version')!r} of AWQ is "
                               f"not supported (gemm)")
    if int(qc.get("bits", 4)) != 4:
        raise UnsupportedModel(f"quantization_config.bits {qc.get('bits')} is not supported "
                               f"for {method} (4)")
    return qc


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words → their 8 nibbles, unpacked along ``dim`` (nibble 0 first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = words.unsqueeze(dim + 1) >> shifts.view([-1] + [1] * (words.dim() - dim - 1))
    return (w & 15).flatten(dim, dim + 1).to(torch.uint8)


def _decode(qc: dict[str, Any], qweight: torch.Tensor, qzeros: torch.Tensor,
            scales: torch.Tensor) -> Decoded:
    """``(codes [out, in], scale [out, groups], offset)`` of one GPTQ / AWQ weight."""
    if qc["quant_method"].lower() == "gptq":
        q = _nibbles(qweight, 0)  # [in, out]
        z = _nibbles(qzeros, 1).to(torch.int32)  # [groups, out]
        if str(qc.get("checkpoint_format", "gptq")).lower() != "gptq_v2":
            z = z + 1
    else:
        order = torch.tensor(_AWQ_ORDER)
        q = _nibbles(qweight, 1).unflatten(1, (-1, 8))[:, :, order].flatten(1)
        z = _nibbles(qzeros, 1).unflatten(1, (-1, 8))[:, :, order].flatten(1).to(torch.int32)
    s = scales.float()
    return q.t().contiguous(), s.t().contiguous(), (-s * z).t().contiguous()


def _contiguous_groups(g_idx: torch.Tensor | None, inputs: int, groups: int) -> bool:
    return g_idx is None or torch.equal(g_idx.long(), torch.arange(inputs) // (inputs // groups))


def load(model_dir: str | Path, qc: dict[str, Any], layout: ShardLayout, dtype: torch.dtype,
         quant: QuantConfig) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """This rank's share of a GPTQ / AWQ checkpoint: ``(floats, packed)`` by HF name — every
    quantized weight in ``packed`` when the replica serves int4 and its groups are
    contiguous, else dequantized into ``floats`` (logged) with the other tensors.

    Raises:
        QuantLayoutError: a tensor-parallel split that cuts a group.
    """
    raw = load_weights(model_dir)
    floats: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    dequantized: list[str] = []
    for prefix in sorted(n[: -len(".qweight")] for n in raw if n.endswith(".qweight")):
        qweight, qzeros, scales, g_idx = (raw.pop(prefix + p, None) for p in _PARTS)
        name = prefix + ".weight"
        if name == "lm_head.weight" and not layout.holds_lm_head:
            continue
        if qweight is None or qzeros is None or scales is None:
            raise ValueError(f"{prefix}: a {qc['quant_method']} weight needs qweight, qzeros "
                             f"and scales")
        decoded = _decode(qc, qweight, qzeros, scales)
        groups = decoded[1].shape[1]
        if quant.bits == 4 and _contiguous_groups(g_idx, decoded[0].shape[1], groups):
            packed[name] = pack_codes(4, *shard_decoded(name, decoded, layout))
            continue
        if g_idx is not None:  # act-order: input k belongs to group g_idx[k]
            group, offset = g_idx.long(), decoded[2]
            assert offset is not None  # int4 weights always have offsets
            decoded = (decoded[0], decoded[1][:, group], offset[:, group])
        w = dequantize_decoded(decoded)
        floats[name] = shard_tensor(name, w, layout).to(dtype)
        dequantized.append(name)
    for name, t in raw.items():
        if name == "lm_head.weight" and not layout.holds_lm_head:
            continue
        t = shard_tensor(name, t, layout)
        floats[name] = t.to(dtype) if t.is_floating_point() else t
    log.info("%s checkpoint: %d weights repacked as int4 as they are, %d dequantized to float%s",
             qc["quant_method"], len(packed), len(dequantized),
             f" (then quantized as --quantization {quant.method} asks)" if quant.bits and dequantized
             else "")
    return floats, packed
