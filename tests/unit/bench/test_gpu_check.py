"""bench/engine/gpu_check.py on CPU, as the lent GPU machine will run it: from the bare checkout
(kvfleet not installed) in a Python without Ray, Redis or OpenTelemetry."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "engine" / "gpu_check.py"
# What the GPU machine lacks: these, and any installed kvfleet (the editable install's finder).
ABSENT = re.compile(r"^(ray|redis|opentelemetry|kvfleet|__editable__)([-_.]|$)", re.I)

# Runs under `python -S` (no site: no .pth files, so no editable finder) with a view of
# site-packages that leaves the absent packages out; proves they are absent, then runs the script.
_LAUNCH = """
import importlib.util, runpy, sys
sys.path.append(sys.argv.pop(1))
for name in ("ray", "redis", "opentelemetry", "kvfleet", "kvfleet.worker"):
    try:
        assert importlib.util.find_spec(name) is None, name + " is importable"
    except ModuleNotFoundError:  # kvfleet.worker: its parent is not there either
        pass
sys.argv[0] = sys.argv[1]
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def _site_view(tmp: Path) -> Path:
    """A directory of symlinks to every site-packages entry except the absent ones."""
    view = tmp / "site-packages"
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not ABSENT.match(entry.name) and entry.suffix != ".pth":
            (view / entry.name).symlink_to(entry)
    return view


def test_cpu_run_from_bare_checkout_without_ray_redis_otel(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _LAUNCH, str(_site_view(tmp_path)), str(SCRIPT),
         "--device", "cpu", "--batches", "1,4", "--repeats", "1", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["imports"] == {"kvfleet": str(ROOT), "blocked_loaded": []}
    assert result["parity_passed"]
    assert [p["dtype"] for p in result["parity"]] == ["fp32", "bf16"]
    for p in result["parity"]:
        assert p["passed"] and p["cached_prompt_tokens"] == 48 and p["rows"] > 50, p
    fp32, bf16 = result["parity"]
    assert fp32["max_abs_vs_hf_fp32"] <= 1e-4 * fp32["scale"]
    assert 0 < bf16["hf_bf16_vs_hf_fp32"] and bf16["max_abs_vs_hf_fp32"] <= bf16["tolerance"]
    rows = result["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        for key in ("kvfleet_tokens_per_s", "hf_tokens_per_s", "kvfleet_step_ms", "hf_step_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["kvfleet_tokens"] == r["hf_tokens"] == r["batch"] * (result["decode"]["new_tokens"] - 1)
    for line in ("parity (engine logits", "decode tokens/s", "PASS"):
        assert line in proc.stdout
    assert "FAIL" not in proc.stdout


def test_parity_check_fails_on_a_top_left_causal_mask(tmp_path: Path, monkeypatch) -> None:
    """Negative control: the classic paged-attention bug (a continued chunk masked with the
    top-left square instead of the mask offset by its cached tokens) must fail the check."""
    import tokenizers

    from bench.engine import gpu_check
    from kvfleet.worker.runner import attention

    hf = gpu_check.build_model("tiny", torch.device("cpu"), tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    runner = gpu_check.make_runner(tmp_path, torch.float32, torch.device("cpu"), 96)
    assert gpu_check.check_parity("fp32", runner, tok, {"fp32": hf}, torch.device("cpu"))["passed"]

    def top_left(num_computed: int, q_len: int, window: int | None) -> torch.Tensor:
        return torch.arange(num_computed + q_len)[None, :] <= torch.arange(q_len)[:, None]

    monkeypatch.setattr(attention, "causal_mask", top_left)
    rec = gpu_check.check_parity("fp32", runner, tok, {"fp32": hf}, torch.device("cpu"))
    assert not rec["passed"] and rec["max_abs_vs_hf_fp32"] > 100 * rec["tolerance"], rec
    # bf16's looser tolerance still catches it.
    models = {"fp32": hf, "bf16": gpu_check.load_hf(tmp_path, torch.bfloat16, torch.device("cpu"))}
    runner16 = gpu_check.make_runner(tmp_path, torch.bfloat16, torch.device("cpu"), 96)
    rec = gpu_check.check_parity("bf16", runner16, tok, models, torch.device("cpu"))
    assert not rec["passed"] and rec["max_abs_vs_hf_fp32"] > 3 * rec["tolerance"], rec


def test_package_dirs_without_tomllib(monkeypatch) -> None:
    """An older python3 (no tomllib) reads the same package-dir table."""
    from bench.common import source_tree

    want = source_tree.package_dirs()
    assert want["kvfleet.worker"] == ROOT / "worker"
    monkeypatch.setitem(sys.modules, "tomllib", None)
    assert source_tree.package_dirs() == want

