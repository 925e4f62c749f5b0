"""Read a model directory's ``*.safetensors`` (single file or sharded with an index), no transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the model: the index's shards, else every ``*.safetensors``.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
    """
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [d / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    return files


def load_weights(model_dir: str | Path, dtype: torch.dtype | None = None,
                 read: Callable[[Any, str], torch.Tensor | None] | None = None
                 ) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by HF name, float ones cast to ``dtype`` when given (CPU
    tensors; integer ones, packed MXFP4 blocks and scales, stay as stored).

    ``read(f, name)``, when given, reads tensor ``name`` from the open safetensors file ``f``
    instead of the whole tensor (a slice, say), or returns None to leave it out.

    Raises:
        FileNotFoundError: see :func:`weight_files`.
        ValueError: a tensor name appears in two shards.
    """
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in out:
                    raise ValueError(f"tensor {name} appears in more than one shard ({path.name})")
                t = f.get_tensor(name) if read is None else read(f, name)
                if t is not None:
                    cast = dtype is not None and t.dtype != dtype and t.is_floating_point()
                    out[name] = t.to(dtype) if cast else t
    return out
