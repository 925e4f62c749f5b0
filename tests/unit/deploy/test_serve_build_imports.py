"""Serve runs an application's builder (``kvfleet.deploy.serve_app:build``) in a fresh
process for every deploy and every rollout, on the path of each cluster start: that process
must not import torch (about 4 s of each start; the replica process imports it)."""

from __future__ import annotations

import subprocess
import sys

BUILD = """
import sys
from ray import cloudpickle
from kvfleet.deploy.serve_app import build
app = build({"replica": {}, "count": 2, "revision": "r"})
cls = app._bound_deployment.func_or_class
heavy = sorted(m for m in ("torch", "transformers", "kvfleet.worker.replica.replica")
               if m in sys.modules)
print(cls.__module__, cls.__qualname__, len(cloudpickle.dumps(cls)), heavy)
"""


def test_the_serve_build_step_imports_no_torch_and_pickles_the_class_by_name() -> None:
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    module, name, pickled, heavy = out.stdout.split(maxsplit=3)
    assert (module, name) == ("kvfleet.worker.replica.serve_deployment", "ServeReplica")
    # By reference (module and name): the replica process imports the module itself.
    assert int(pickled) < 200
    assert heavy.strip() == "[]"
