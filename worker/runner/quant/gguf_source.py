"""Quantized weights read from the GGUF a model directory was prepared from, as they are.

A model directory may hold, beside its float safetensors, the one ``*.gguf`` file it was
converted from (``kvfleet model prepare`` keeps it). When a replica serves ``int8`` / ``int4``,
every quantizable tensor whose GGUF block type maps to those bits (:mod:`.gguf_blocks`) is
packed from its blocks directly: no float round trip. Each one is checked first: its blocks,
dequantized, must equal the float tensor the directory holds, bit for bit (in the model
dtype) — which also settles the row order of Q and K (llama.cpp's converter permutes their
rows for its RoPE layout). A tensor of another type, or one that does not match, is left to
the caller to quantize from its float values, and the log says so. The ``gguf`` package
(``pip install gguf``) reads the file; without it every tensor is quantized from its floats.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kvfleet.worker.runner.quant.gguf_blocks import DECODERS
from kvfleet.worker.runner.quant.packed import Decoded, PackedWeight, dequantize_decoded, pack_codes
from kvfleet.worker.runner.quant.shard import shard_decoded
from kvfleet.worker.runner.tp.layout import ShardLayout

log = logging.getLogger(__name__)


def find_gguf(model_dir: str | Path) -> Path | None:
    """The directory's one ``*.gguf`` file, or None (none, or several: logged)."""
    files = sorted(Path(model_dir).glob("*.gguf"))
    if len(files) > 1:
        log.warning("%s holds %d GGUF files; reading none of them as the weights' source",
                    model_dir, len(files))
    return files[0] if len(files) == 1 else None


def _llama_rows(out: int, heads: int) -> torch.Tensor:
    """GGUF row ``j`` of a llama Q/K weight is HF row ``index[j]`` (llama.cpp's converter
    interleaves each head's two rotary halves)."""
    half = out // heads // 2
    return torch.arange(out).view(heads, 2, half).transpose(1, 2).reshape(-1)


def _reordered(d: Decoded, rows: torch.Tensor) -> Decoded:
    return d[0][rows], d[1][rows], None if d[2] is None else d[2][rows]


class _Reader:
    """The GGUF's tensors by HF name (through the ``gguf`` package's name map)."""

    def __init__(self, path: Path, num_layers: int) -> None:
        import gguf  # optional: only a directory holding a GGUF needs it

        self.reader = gguf.GGUFReader(path)
        arch_name = self.reader.fields["general.architecture"].contents()
        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
        self.names = gguf.get_tensor_name_map(arch, num_layers)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.heads = {"q_proj": self._field(f"{arch_name}.attention.head_count"),
                      "k_proj": self._field(f"{arch_name}.attention.head_count_kv")}

    def _field(self, key: str) -> int | None:
        field = self.reader.fields.get(key)
        return None if field is None else int(field.contents())

    def tensor(self, hf_name: str) -> Any | None:
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return None if name is None else self.tensors.get(name)

    def row_orders(self, hf_name: str, out: int) -> list[torch.Tensor | None]:
        """Candidate HF row orders: as stored, then llama.cpp's Q/K permutation."""
        heads = self.heads.get(hf_name.split(".")[-2])
        return [None] + ([torch.argsort(_llama_rows(out, heads))] if heads else [])


def native_weights(model_dir: str | Path, layout: ShardLayout, bits: int,
                   floats: dict[str, torch.Tensor]) -> dict[str, PackedWeight]:
    """Packed weights, by HF name, for every tensor of ``floats`` (this rank's float tensors)
    that the directory's GGUF holds in a block type of ``bits`` bits and that matches its
    float exactly; empty without a GGUF (see the module docstring).

    Raises:
        QuantLayoutError: a tensor-parallel split that cuts a GGUF block.
    """
    path = find_gguf(model_dir)
    if path is None:
        return {}
    try:
        reader = _Reader(path, _num_layers(floats))
    except ImportError:
        log.warning("%s: the gguf package is not installed; quantizing the float weights "
                    "instead of reading its blocks (pip install gguf)", path.name)
        return {}
    out: dict[str, PackedWeight] = {}
    kept: Counter[str] = Counter()
    requantized: dict[str, list[str]] = {}
    for name, t in floats.items():
        src = reader.tensor(name)
        if src is None or t.dim() != 2:
            continue
        kind = src.tensor_type.name
        decoder = DECODERS.get(kind)
        packed = _match(reader, name, src, decoder[1], t, layout) if decoder and decoder[0] == bits else None
        if packed is None:
            requantized.setdefault(kind, []).append(name)
        else:
            out[name] = packed
            kept[kind] += 1
    log.info("int%d weights from %s: %s as they are; quantized from their float values: %s",
             bits, path.name, ", ".join(f"{n} {k}" for k, n in sorted(kept.items())) or "none",
             "; ".join(f"{len(names)} {kind} ({_some(names)})"
                       for kind, names in sorted(requantized.items())) or "none")
    return out


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", … {len(names) - shown} more" if len(names) > shown else "")


def _match(reader: _Reader, name: str, src: Any, decode: Any, want: torch.Tensor,
           layout: ShardLayout) -> PackedWeight | None:
    """The tensor's blocks in HF row order, this rank's share, packed, if it equals ``want``."""
    decoded = decode(src.data)
    for rows in reader.row_orders(name, decoded[0].shape[0]):
        d = shard_decoded(name, decoded if rows is None else _reordered(decoded, rows), layout)
        if d[0].shape == want.shape and torch.equal(dequantize_decoded(d).to(want.dtype), want):
            return pack_codes(8 if d[2] is None else 4, *d)
    log.warning("%s: the GGUF's %s blocks do not match the directory's float weights; "
                "quantizing the float weights instead", name, src.tensor_type.name)
    return None


def _num_layers(floats: dict[str, torch.Tensor]) -> int:
    layers = [int(n.split(".")[2]) for n in floats if n.startswith("model.layers.")]
    return max(layers) + 1 if layers else 0
