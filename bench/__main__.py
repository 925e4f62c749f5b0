"""``python -m bench [NAME [ARGS...]]``: list the benchmarks by group, or run the one named
``NAME`` (module ``NAME`` or ``NAME_bench`` of a group), which must define
``main(argv: list[str]) -> int``.

Groups (one folder each): ``engine`` (the engine and model in this process), ``sim`` (the
real scheduler and policies on a virtual clock), ``cluster`` (real routers and replicas,
processes or Ray); ``common`` holds the helpers they share (workload, load, reports, plots)
and runs nothing.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

GROUPS = {"engine": "the engine and model, in this process",
          "sim": "the real scheduler and policies on a virtual clock",
          "cluster": "real routers and replicas (processes or Ray)"}


def _benches() -> dict[str, dict[str, str]]:
    """group → {name → first docstring line}, for every module of a group defining ``main``."""
    found: dict[str, dict[str, str]] = {}
    for group in GROUPS:
        found[group] = {}
        for info in pkgutil.iter_modules([str(Path(__file__).parent / group)]):
            module = importlib.import_module(f"bench.{group}.{info.name}")
            if callable(getattr(module, "main", None)):
                doc = (module.__doc__ or "").strip()
                found[group][info.name.removesuffix("_bench")] = doc.splitlines()[0] if doc else ""
    return found


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m bench NAME [ARGS...]   (NAME --help for its options)")
        for group, benches in _benches().items():
            print(f"\n{group} ({GROUPS[group]}):")
            for name, doc in sorted(benches.items()):
                print(f"  {name:18s} {doc}")
        return 0
    name, rest = argv[0], argv[1:]
    module = resolve(name)
    if module is None:
        known = sorted(n for benches in _benches().values() for n in benches)
        print(f"unknown benchmark {name!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


def resolve(name: str):
    """The module ``python -m bench NAME`` runs (``NAME_bench`` or ``NAME`` of a group, with a
    ``main``), or None."""
    for group in GROUPS:
        for module_name in (f"bench.{group}.{name}_bench", f"bench.{group}.{name}"):
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                continue
            if callable(getattr(module, "main", None)):
                return module
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
