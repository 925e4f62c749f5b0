"""The committed stubs in kvfleet/v1 must equal a fresh protoc run over proto/."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("kvfleet_proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    fresh = _load_generator().generate(tmp_path)
    assert fresh, "protoc generated nothing"
    committed_dir = ROOT / "kvfleet" / "v1"
    stale = [p.name for p in fresh if (committed_dir / p.name).read_bytes() != p.read_bytes()]
    extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in fresh}
    assert not stale and not extra, (
        f"stale stubs {stale}, orphaned stubs {sorted(extra)}: run `python proto/generate.py`"
    )


def test_stubs_import_as_kvfleet_v1():
    from kvfleet.v1 import common_pb2, router_pb2_grpc, worker_pb2_grpc

    assert hasattr(router_pb2_grpc, "RouterServicer")
    assert hasattr(worker_pb2_grpc, "WorkerStub")
    msg = common_pb2.SamplingParams()
    assert not msg.HasField("temperature")  # proto3 optional: unset differs from 0
    msg.temperature = 0.0
    assert msg.HasField("temperature")
