"""The CPUs this process may use: its affinity set, capped by its cgroup's CPU quota.

``os.cpu_count()`` is the host's core count: a pod limited to 4 CPUs on a 64-core node sees
64. What a process can actually use is the smaller of the cores it may run on
(``os.sched_getaffinity``) and its cgroup's quota (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), the tightest limit on the path from its own
cgroup up to the root. Read at call time, never at import.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Optional[Path] = None) -> str:
    """The processor's model name (``cpuinfo``, default ``/proc/cpuinfo``), else what
    :mod:`platform` knows (often only the architecture)."""
    try:
        for line in (cpuinfo or CPUINFO).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_cpus(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None) -> float:
    """CPUs this process may use (> 0; fractional under a fractional quota, e.g. 1.5).

    ``root`` / ``proc_cgroup``: where the cgroup file system and this process's cgroup
    membership are read (default :data:`CGROUP_ROOT`, :data:`PROC_CGROUP`). Unreadable
    files mean no quota.
    """
    cores = float(_affinity())
    quota = cgroup_quota(root, proc_cgroup)
    return min(cores, quota) if quota is not None else cores


def whole_cpus(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None) -> int:
    """:func:`available_cpus` rounded up to whole CPUs (thread counts), at least 1."""
    return max(1, math.ceil(available_cpus(root, proc_cgroup) - 1e-9))


def cgroup_quota(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None
                 ) -> Optional[float]:
    """The tightest CPU quota (in CPUs) on the path from this process's cgroup to the root,
    or None when there is none (or it cannot be read)."""
    root = root or CGROUP_ROOT
    try:
        lines = (proc_cgroup or PROC_CGROUP).read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # cgroup v2: one unified hierarchy
            quotas += _along(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                if (root / mount).is_dir():
                    quotas += _along(root / mount, path, _v1_quota)
                    break
    return min(quotas) if quotas else None


def _along(base: Path, path: str, read) -> list[float]:
    """``read(dir)`` for each directory from ``base/path`` up to ``base`` (the quotas set)."""
    out = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        quota = read(base.joinpath(*parts[:depth]))
        if quota is not None:
            out.append(quota)
    return out


def _v2_quota(d: Path) -> Optional[float]:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _ratio(quota, period)


def _v1_quota(d: Path) -> Optional[float]:
    try:
        quota = (d / "cpu.cfs_quota_us").read_text().strip()
        period = (d / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> Optional[float]:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _affinity() -> int:
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return max(1, len(getaffinity(0)))
    return os.cpu_count() or 1
