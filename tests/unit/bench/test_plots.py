"""bench/common/plots.py: every bench plot is a matplotlib PNG (Agg, no display)."""

from __future__ import annotations

from pathlib import Path

from bench.common.plots import line_plot, lines_plot, plot_ttft_cdfs


def _png_size(path: Path) -> tuple[int, int]:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_line_plot_writes_a_png(tmp_path: Path) -> None:
    out = line_plot(tmp_path / "sub" / "curve.png", [16, 256, 1024], [24.7, 26.0, 29.5],
                    "SmolLM2 batch-1 decode step (ms) vs context", "context (tokens)", "ms")
    assert out == tmp_path / "sub" / "curve.png"
    assert _png_size(out) == (768, 480)


def test_ttft_cdfs_write_a_png(tmp_path: Path) -> None:
    out = plot_ttft_cdfs({"prefix_aware": [0.05, 0.1, 0.2], "round_robin": [0.3, 0.9], "empty": []},
                         tmp_path / "cdf.png", "uniform, 4 replicas")
    assert _png_size(out) == (840, 504)


def test_lines_plot_writes_a_png(tmp_path: Path) -> None:
    out = lines_plot(tmp_path / "step.png", {"tp=1": ([1, 4, 16], [30.0, 33.0, 52.0]),
                                             "tp=2": ([1, 4, 16], [24.0, 26.0, 40.0])},
                     "decode step (ms) vs batch", "batch", "ms")
    assert _png_size(out) == (768, 480)
