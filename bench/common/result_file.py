"""Where a benchmark writes its JSON record: ``bench/results/<name>``."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results
ROOT = RESULTS.parents[1]  # the checkout


def write_json(name: str, record: dict, indent: int = 2) -> Path:
    """Write ``record`` as JSON to ``RESULTS / name`` (the folder is created), say where, and
    return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(record, indent=indent) + "\n")
    print(f"wrote {path}")
    return path
