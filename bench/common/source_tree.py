"""Import ``kvfleet.*`` straight from a source checkout, without installing it.

Installed, kvfleet's top-level folders become subpackages of one package (pyproject.toml's
``[tool.setuptools.package-dir]``: ``kvfleet.worker`` → ``worker/``, …). A machine that gets
only the working tree (the lent GPU machine: no registry, nothing installed) has no such
mapping, so :func:`install` puts a finder first on ``sys.meta_path`` that reads the same table
from the checkout's pyproject.toml. Subpackages the table does not name (``kvfleet.worker.
models``) resolve through their parent's ``__path__`` as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/common/ is two below


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{"kvfleet.worker": root / "worker", …}`` from ``root/pyproject.toml``.

    Raises:
        FileNotFoundError: no pyproject.toml; ValueError: it has no package-dir table.
    """
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # an older python3 on a bare machine: the table is flat
        section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        table = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1) if section else "", re.M))
    else:
        table = tomllib.loads(text).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    if "kvfleet" not in table:
        raise ValueError(f"{root / 'pyproject.toml'} has no [tool.setuptools.package-dir] for kvfleet")
    return {name: root / folder for name, folder in table.items()}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds the packages of the package-dir table in the checkout; nothing else."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install(root: Path = ROOT) -> None:
    """Make ``import kvfleet.…`` load from ``root`` (default: the checkout holding this file).

    Idempotent. Ahead of any installed kvfleet, so the code measured is the code beside this
    script. Raises RuntimeError if a kvfleet from elsewhere is already imported.
    """
    if any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        return
    loaded = sys.modules.get("kvfleet")
    if loaded is not None:
        where = Path(loaded.__file__).resolve().parent
        if where != (root / "kvfleet").resolve():
            raise RuntimeError(f"kvfleet is already imported from {where}, not from {root}")
    sys.meta_path.insert(0, _SourceTreeFinder(package_dirs(root)))
    importlib.invalidate_caches()
