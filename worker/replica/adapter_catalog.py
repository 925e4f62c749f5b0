"""A replica's servable adapters from the command line: ``NAME=DIR`` pairs and directories
of adapters (each subdirectory one adapter, named by it), each checked against the model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from kvfleet.worker.runner.lora.adapter import AdapterSpec, check_adapter
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
