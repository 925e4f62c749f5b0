"""A replica's servable adapters from the command line: ``NAME=DIR`` pairs and directories
of adapters (each subdirectory one adapter, named by it), each checked against the model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from kvfleet.errors import InvalidArgument, PermissionDenied
from kvfleet.worker.runner.lora.adapter import WEIGHTS_FILE, AdapterSpec, check_adapter
from kvfleet.worker.runner.lora.config import CONFIG_FILE, AdapterError
from kvfleet.worker.runner.model_config import ModelConfig

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def parse_adapter_arg(arg: str) -> tuple[str, str]:
    """``"NAME=DIR"`` → ``(name, dir)``.

    Raises:
        ValueError: no ``=``, or a name that is not 1-128 of ``[A-Za-z0-9._-]`` (first
            alphanumeric).
    """
    name, sep, path = arg.partition("=")
    if not sep or not path:
        raise ValueError(f"--adapter takes NAME=DIR, got {arg!r}")
    check_name(name)
    return name, path


def check_name(name: str) -> str:
    """Raises ValueError for a name that is not 1-128 of ``[A-Za-z0-9._-]`` (first alphanumeric)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r} must be 1-128 characters of A-Z a-z 0-9 . _ - "
                         f"(the first a letter or digit)")
    return name


def expand_adapter_dirs(pairs: Sequence[tuple[str, str]], dirs: Sequence[str]
                        ) -> tuple[tuple[str, str], ...]:
    """``pairs`` plus every subdirectory holding an ``adapter_config.json`` of each of
    ``dirs``, named by the subdirectory; absolute paths.

    Raises:
        ValueError: a directory that does not exist, or a name given twice.
    """
    out: dict[str, str] = {}
    found = list(pairs)
    for d in dirs:
        root = Path(d)
        if not root.is_dir():
            raise ValueError(f"--adapter-dir {d}: not a directory")
        found += [(sub.name, str(sub)) for sub in sorted(root.iterdir())
                  if (sub / CONFIG_FILE).is_file()]
    for name, path in found:
        check_name(name)
        if name in out:
            raise ValueError(f"adapter {name!r} is given twice ({out[name]} and {path})")
        out[name] = str(Path(path).resolve())
    return tuple(out.items())


def check_catalog(adapters: Sequence[tuple[str, str]], model: ModelConfig, max_lora_rank: int
                  ) -> dict[str, AdapterSpec]:
    """Check every ``(name, dir)`` against ``model``.

    Raises:
        AdapterError: the first bad adapter, naming it, its file and the field.
    """
    catalog = {}
    for name, path in adapters:
        try:
            catalog[name] = check_adapter(name, path, model, max_lora_rank)
        except AdapterError as exc:
            raise AdapterError(f"adapter {name!r}: {exc}") from exc
    return catalog


def adapter_roots(pairs: Sequence[tuple[str, str]], dirs: Sequence[str], roots: Sequence[str] = ()
                  ) -> tuple[str, ...]:
    """The directories a runtime ``LoadAdapter`` may read from: each ``--adapter`` directory,
    each ``--adapter-dir`` and each ``--adapter-root``, resolved (symlinks followed), sorted."""
    return tuple(sorted({str(Path(p).resolve()) for p in [*(d for _, d in pairs), *dirs, *roots]}))


def confine(path: str, roots: Sequence[str]) -> Path:
    """``path`` resolved, checked to lie inside one of ``roots`` (see :func:`adapter_roots`),
    its adapter files too (a symlink out of a root is refused like a path out of it).

    Raises:
        InvalidArgument: ``path`` is empty or relative (field ``path``).
        PermissionDenied: ``path`` holds a ``..`` component, or it or one of its adapter files
            resolves outside every root, or no root is configured (the message names the path).
    """
    if not path or not Path(path).is_absolute():
        raise InvalidArgument(f"path {path!r} must be an absolute directory on the replica",
                              field="path")
    if ".." in Path(path).parts:
        raise PermissionDenied(f"path {path!r}: '..' is not allowed in an adapter path",
                               field="path")
    if not roots:
        raise PermissionDenied(f"path {path!r}: this replica takes no adapters at run time "
                               f"(start it with --adapter-root, --adapter-dir or --adapter)",
                               field="path")
    resolved = Path(path).resolve()
    bases = [Path(r) for r in roots]
    for real in (resolved, *adapter_files(resolved)):
        if not any(real == b or b in real.parents for b in bases):
            raise PermissionDenied(f"path {path!r}: {real} lies outside the adapter directories "
                                   f"this replica was started with", field="path")
    return resolved


def adapter_files(directory: Path) -> tuple[Path, ...]:
    """The real paths (symlinks followed) of ``directory``'s adapter files that exist."""
    return tuple((directory / f).resolve() for f in (CONFIG_FILE, WEIGHTS_FILE)
                 if (directory / f).exists())
