"""Import layering, checked on the source (an AST scan, every import statement: top level,
inside functions, under TYPE_CHECKING): the router runs without the worker package, and the
shared code (``kvfleet/``, ``allocator/``) imports neither side. What both sides need lives
in the shared code."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Source folder -> the installed packages its modules must not import.
FORBIDDEN = {
    "router": ("kvfleet.worker", "kvfleet.deploy"),
    "allocator": ("kvfleet.router", "kvfleet.worker", "kvfleet.deploy"),
    "kvfleet": ("kvfleet.router", "kvfleet.worker", "kvfleet.deploy"),
}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (relative ones excluded:
    the tree uses none)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, name in imported_modules(path.read_text()):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return out


def test_the_scan_sees_every_kind_of_import() -> None:
    source = ("import kvfleet.worker.engine\nfrom kvfleet import worker\n"
              "def f():\n    from kvfleet.worker.step_cost.model import MEASURED\n")
    names = [name for _, name in imported_modules(source)]
    assert "kvfleet.worker.engine" in names and "kvfleet.worker" in names
    assert "kvfleet.worker.step_cost.model" in names


def test_the_router_and_the_shared_code_import_no_other_side() -> None:
    found = [v for folder, forbidden in FORBIDDEN.items() for v in violations(folder, forbidden)]
    assert found == []
