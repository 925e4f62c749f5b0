"""Cheap, deterministic fingerprints of a model directory (DESIGN.md §2).

A fingerprint digests ``config.json``, the safetensors *headers* (tensor names, dtypes,
shapes, byte ranges — not the weight bytes), ``tokenizer.json`` and the chat template, so
router and worker agree on identity without reading gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFingerprints:
    """Hex sha256 digests of the parts of a model directory that decide cache contents."""

    weights: str
    tokenizer: str
    chat_template: str


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_chat_template(model_dir: Path) -> str:
    """The model's chat template: ``chat_template.jinja`` or ``tokenizer_config.json``'s field.

    Returns "" when the model has none.
    """
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.exists():
        tmpl = json.loads(cfg.read_text()).get("chat_template") or ""
        return tmpl if isinstance(tmpl, str) else json.dumps(tmpl, sort_keys=True)
    return ""


def fingerprint_model_dir(model_dir: str | Path) -> ModelFingerprints:
    """Fingerprint a HuggingFace-format model directory.

    Raises:
        FileNotFoundError: ``config.json`` or every ``*.safetensors`` file is missing.
    """
    d = Path(model_dir)
    weights = hashlib.sha256()
    weights.update((d / "config.json").read_bytes())
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    for f in files:
        weights.update(f.name.encode())
        weights.update(json.dumps(_safetensors_header(f), sort_keys=True).encode())
    tok = d / "tokenizer.json"
    tokenizer = hashlib.sha256(tok.read_bytes() if tok.exists() else b"").hexdigest()
    template = hashlib.sha256(read_chat_template(d).encode()).hexdigest()
    return ModelFingerprints(weights.hexdigest(), tokenizer, template)
