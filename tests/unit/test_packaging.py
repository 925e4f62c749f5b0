"""The wheel holds every module of the tree: built from a copy of the sources, installed with
``pip install --no-deps`` into a fresh venv (no pip, no kvfleet of the development venv), and
imported module by module there, with the development venv's site-packages on PYTHONPATH for
the dependencies only (PYTHONPATH entries run no ``.pth``: the editable install stays out).

A package folder the build leaves out (a hand-kept list that misses one) fails the import of
its modules; a missing data file (the C kernels' sources) fails the file check."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a build reads besides the package folders.
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")  # those present

IMPORT_ALL = """
import importlib, json, sys
names, prefix = json.loads(sys.argv[1]), sys.argv[2]
failed = []
for name in names:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # report every module that does not import, not only the first
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
        continue
    if not (getattr(module, "__file__", None) or "").startswith(prefix):
        failed.append(f"{name}: imported from {module.__file__}, not the installed wheel")
print(json.dumps(failed))
"""


def package_roots() -> dict[str, str]:
    """Import name → source folder, as pyproject.toml maps them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def tree_modules() -> list[str]:
    """Every importable module of the source tree, by its installed name."""
    names = set()
    for name, folder in package_roots().items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts or path.name == "__main__.py":
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.add(".".join([name, *parts]))
    return sorted(names)


def test_tree_modules_cover_every_package_folder() -> None:
    # Guards the walk above: the kv tier's folder is one a hand-kept list missed.
    assert "kvfleet.worker.kv_tier" in tree_modules()
    assert "kvfleet.router.main" in tree_modules()


def test_the_wheel_installs_every_module_of_the_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_FILES:
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for folder in {f.split("/")[0] for f in package_roots().values()}:
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    run = lambda *cmd, **kw: subprocess.run(cmd, capture_output=True, text=True,  # noqa: E731
                                            timeout=300, **kw)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src))
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("kvfleet-*.whl")

    venv = tmp_path / "venv"
    made = run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    assert made.returncode == 0, made.stderr[-3000:]
    python = venv / "bin" / "python"
    installed = run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--no-index", "-q", str(wheel))
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    prefix = site.stdout.strip() + "/kvfleet"
    assert (Path(prefix) / "worker" / "runner" / "paged_decode.c").is_file()
    for header in ("kernels.h", "quant/qkernels.h"):  # the kernel sources include them
        assert (Path(prefix) / "worker" / "runner" / header).is_file()

    import json

    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    out = run(str(python), "-c", IMPORT_ALL, json.dumps(tree_modules()), prefix,
              cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
