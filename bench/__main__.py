"""``python -m bench [NAME [ARGS...]]``: list the benchmarks, or run ``bench.NAME`` (or
``bench.NAME_bench``), which must define ``main(argv: list[str]) -> int``."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def _benches() -> dict[str, str]:
    """name → first docstring line, for every module here that defines ``main``."""
    found = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"bench.{info.name}")
        if callable(getattr(module, "main", None)):
            name = info.name.removesuffix("_bench")
            found[name] = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
    return found


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m bench NAME [ARGS...]   (NAME --help for its options)\n")
        for name, doc in sorted(_benches().items()):
            print(f"  {name:12s} {doc}")
        return 0
    name, rest = argv[0], argv[1:]
    for module_name in (f"bench.{name}_bench", f"bench.{name}"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        return int(module.main(rest) or 0)
    print(f"unknown benchmark {name!r}; known: {', '.join(sorted(_benches()))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
