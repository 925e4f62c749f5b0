"""``python -m bench``: benchmarks listed by group, and every benchmark README and docs/ cite
by name (``python -m bench NAME``, ``bash run.sh bench NAME``, `` `bench NAME` ``) resolves
to a module with a ``main``."""

from __future__ import annotations

import re
from pathlib import Path

from bench.__main__ import GROUPS, main, resolve

ROOT = Path(__file__).resolve().parents[3]
CITATION = re.compile(r"(?:python -m bench|bash run\.sh bench|`bench) ([a-z0-9_]+)")


def cited() -> set[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {name for page in pages for name in CITATION.findall(page.read_text())}


def test_every_cited_benchmark_resolves() -> None:
    names = cited()
    assert {"engine", "router", "ttft_routing", "kv_tier", "tier_b2b_real"} <= names
    assert [n for n in sorted(names) if resolve(n) is None] == []


def test_the_listing_shows_each_group_and_only_runnable_modules(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    headers = [line.split(" (")[0] for line in out.splitlines() if line and not line[0].isspace()]
    assert headers[1:] == list(GROUPS)  # after the usage line
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert "engine" in listed and "ttft_routing" in listed and "router" in listed
    assert not listed & {"workload", "plots", "engine_runs"}
    assert main(["no_such_bench"]) == 2
