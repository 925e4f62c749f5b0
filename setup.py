"""Packaging's one computed setting: the package list, found in the tree under each folder that
pyproject.toml's ``[tool.setuptools.package-dir]`` maps (``router/`` installs as
``kvfleet.router``, …), so a new package folder ships without a hand-kept list to miss it.
Everything else is declared in pyproject.toml."""

import tomllib

from setuptools import find_packages, setup

with open("pyproject.toml", "rb") as f:
    ROOTS: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

setup(packages=sorted({p for name, folder in ROOTS.items()
                       for p in (name, *(f"{name}.{sub}" for sub in find_packages(folder)))}))
