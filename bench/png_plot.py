"""A dependency-free line plot written as PNG (zlib + struct): axes, ticks with numbers, a
polyline with point markers and a title, enough to read a latency curve at a glance."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

# 3x5 bitmap glyphs, rows top to bottom, bit 2 = left column.
_FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717",
    "6": "74757", "7": "71111", "8": "75757", "9": "75717", ".": "00002", "-": "00700",
    " ": "00000", "(": "12221", ")": "42224", "/": "11244", "=": "07070", ":": "02020",
    "a": "03553", "b": "44757", "c": "03443", "d": "11757", "e": "07563", "g": "35713",
    "h": "44755", "i": "20222", "k": "45655", "l": "62223", "m": "07775", "n": "06555",
    "o": "02552", "p": "07574", "r": "06544", "s": "03616", "t": "27223", "u": "05557",
    "x": "05255", "y": "55311", "B": "65656", "S": "34716", "T": "72222", "K": "55655",
    "L": "44447", "M": "57755", "V": "55552", "C": "34443", "D": "65556", "P": "65644",
}


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, rgb=(0, 0, 0)) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(rgb)

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb=(0, 0, 0)) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), rgb)

    def text(self, x: int, y: int, s: str, scale: int = 2, rgb=(0, 0, 0)) -> None:
        for ch in s:
            rows = _FONT.get(ch, _FONT.get(ch.lower(), "00000"))
            for r, bits in enumerate(rows):
                for c in range(3):
                    if int(bits, 16) >> (2 - c) & 1:
                        for dx in range(scale):
                            for dy in range(scale):
                                self.dot(x + c * scale + dx, y + r * scale + dy, rgb)
            x += 4 * scale

    def save(self, path: Path) -> None:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
               + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
        Path(path).write_bytes(png)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


def line_plot(path: Path, xs: list[float], ys: list[float], title: str, xlabel: str,
              ylabel: str, width: int = 640, height: int = 400) -> None:
    """Plot ``ys`` against ``xs`` (both axes from 0) into ``path``."""
    c = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    xmax, ymax = max(xs) * 1.05, max(ys) * 1.15
    sx = lambda x: round(left + (right - left) * x / xmax)  # noqa: E731
    sy = lambda y: round(bottom - (bottom - top) * y / ymax)  # noqa: E731
    c.line(left, top, left, bottom)
    c.line(left, bottom, right, bottom)
    for i in range(6):
        xv, yv = xmax * i / 5, ymax * i / 5
        c.line(sx(xv), bottom, sx(xv), bottom + 4)
        c.text(sx(xv) - 8, bottom + 8, _fmt(xv))
        c.line(left - 4, sy(yv), left, sy(yv))
        c.text(8, sy(yv) - 5, _fmt(yv))
    points = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        c.line(x0, y0, x1, y1, (200, 40, 40))
    for x, y in points:
        for dx in range(-2, 3):
            for dy in range(-2, 3):
                c.dot(x + dx, y + dy, (200, 40, 40))
    c.text(left, 12, title)
    c.text((left + right) // 2 - 4 * len(xlabel), height - 22, xlabel)
    c.text(8, top - 20, ylabel)
    c.save(path)
