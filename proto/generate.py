"""Regenerate the committed gRPC stubs in kvfleet/v1/ from proto/kvfleet/v1/*.proto.

Usage: python proto/generate.py [OUT_DIR]   (default: the repository root)
Needs grpcio-tools (the `dev` extra); tests/unit/test_proto_stubs.py fails when the
committed stubs differ from a fresh generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("kvfleet/v1/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every proto file; returns the generated files (under out_dir/kvfleet/v1)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "kvfleet" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    for path in generate(root):
        print(path)
