"""Every plot bench/ writes, through matplotlib's Agg backend (no display needed): PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def plot_ttft_cdfs(ttfts: dict[str, Sequence[float]], path: Path, title: str) -> Path:
    """One CDF line per policy (TTFTs in seconds, log-scaled ms axis); writes a PNG."""
    return plot_cdfs(ttfts, path, title, "time to first token (ms, client side)", "requests")


def plot_cdfs(samples: dict[str, Sequence[float]], path: Path, title: str, xlabel: str,
              what: str) -> Path:
    """One CDF line per name (seconds, log-scaled ms axis; ``what`` the samples are); writes a PNG."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.2), dpi=120)
    for name, xs in samples.items():
        s = sorted(xs)
        if s:
            ax.step([x * 1e3 for x in s], [(i + 1) / len(s) for i in range(len(s))],
                    where="post", label=f"{name} (n={len(s)})")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"fraction of {what}")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def line_plot(path: Path, xs: Sequence[float], ys: Sequence[float], title: str, xlabel: str,
              ylabel: str) -> Path:
    """``ys`` against ``xs`` with point markers, both axes from 0; writes a PNG."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 4), dpi=120)
    ax.plot(xs, ys, marker="o", color="tab:red")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def lines_plot(path: Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str,
               xlabel: str, ylabel: str) -> Path:
    """One line with point markers per ``name → (xs, ys)``, y axis from 0; writes a PNG."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 4), dpi=120)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
