"""Cheap, deterministic fingerprints of a model directory (docs/design.md §2).

A fingerprint digests ``config.json``, the safetensors *headers* (tensor names, dtypes,
shapes, byte ranges), 64 bytes at the start and middle of every tensor (so a fine-tuned
revision with the same shapes gets another identity), ``tokenizer.json`` and the chat template,
so router and worker agree on identity without reading gigabytes.
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


SAMPLE_BYTES = 64  # bytes read at the start and at the middle of every tensor


def _sampled_bytes(path: Path, header: dict) -> bytes:
    """``SAMPLE_BYTES`` at the start and the middle of every tensor's data, in name order.

    Headers alone cannot tell a fine-tuned revision from its base (same names, shapes and
    dtypes); a few bytes of every tensor can, without reading gigabytes (two small reads per
    tensor). A revision that changes only bytes no sample covers goes undetected: serve it
    under another model name (the name is part of the identity too).
    """
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        base = 8 + n
        out = []
        for name in sorted(header):
            begin, end = header[name]["data_offsets"]
            for offset in (begin, begin + (end - begin) // 2):
                f.seek(base + offset)
                out.append(f.read(min(SAMPLE_BYTES, end - offset)))
    return b"".join(out)


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


QUANT_METHODS = ("none", "int8", "int4")  # weight-only quantization a replica may serve


def served_weights(weights_fingerprint: str, quantization: str = "none",
                   group_size: int = 32) -> str:
    """The fingerprint of the weights a replica serves: the directory's, plus the weight-only
    quantization (``int8`` / ``int4`` and its group size) when there is one, so that KV
    computed by quantized weights never shares an identity with the float model's. Router
    and worker both derive it from the same settings."""
    if quantization == "none":
        return weights_fingerprint
    return f"{weights_fingerprint}+{quantization}-g{group_size}"


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
        header = _safetensors_header(f)
        weights.update(json.dumps(header, sort_keys=True).encode())
        weights.update(_sampled_bytes(f, header))
    tok = d / "tokenizer.json"
    tokenizer = hashlib.sha256(tok.read_bytes() if tok.exists() else b"").hexdigest()
    template = hashlib.sha256(read_chat_template(d).encode()).hexdigest()
    return ModelFingerprints(weights.hexdigest(), tokenizer, template)
