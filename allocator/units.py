"""Byte sizes and parameter counts: parse what a user types, print numbers with their unit.

docs/design.md §9: bytes are integers; GB = 10^9 and GiB = 2^30 are different units and every
printed number carries its unit. Parsing is exact (``decimal``), so ``1.5GiB`` is exactly
1610612736 bytes and a size that is not a whole number of bytes is refused, never rounded.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
# Parameter counts use decimal suffixes: 7B = 7 * 10^9 parameters.
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_BINARY = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


class UnitError(ValueError):
    """A size or count the user typed that cannot be read; the message names the flag."""


_SIZE_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_COUNT_NAMES = "K, M, B (10^9), T"


def _parse(text: str, units: dict[str, int], accepted: str, what: str, name: str) -> int:
    match = _NUMBER.match(str(text))
    if match is None:
        raise UnitError(f"{name}: cannot read {text!r} as {what}")
    number, suffix = match.groups()
    multiplier = units.get(suffix.lower())
    if multiplier is None:
        raise UnitError(f"{name}: unknown unit {suffix!r} in {text!r} (accepted: {accepted})")
    try:
        value = Decimal(number) * multiplier
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid numbers
        raise UnitError(f"{name}: cannot read {text!r} as {what}") from exc
    if value != value.to_integral_value():
        raise UnitError(f"{name}: {text!r} is not a whole number of {what}")
    return int(value)


def parse_size(text: str, name: str = "SIZE") -> int:
    """Bytes from ``24GiB``, ``80GB``, ``1.5 GiB``, ``512MiB`` or a plain ``25769803776``.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2).
    A bare ``G`` or ``M`` is refused: it would be ambiguous between the two.

    Raises:
        UnitError: unreadable text, unknown unit, or not a whole number of bytes; the
            message starts with ``name`` (the CLI flag).
    """
    return _parse(text, _SIZE_UNITS, _SIZE_NAMES, "bytes", name)


def parse_count(text: str, name: str = "COUNT") -> int:
    """A parameter count from ``7e9``, ``7B``, ``1.5B``, ``405B``, ``70M`` or ``7000000000``.

    Suffixes are decimal: K = 10^3, M = 10^6, B = 10^9, T = 10^12 (``7B`` is 7 * 10^9).

    Raises:
        UnitError: unreadable text, unknown suffix, or not a whole number.
    """
    return _parse(text, _COUNT_UNITS, _COUNT_NAMES, "parameters", name)


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` in exact integer arithmetic (``d`` > 0): blocks for ``n`` tokens, Serve
    replicas for ``n`` kvfleet replicas, a rank's share of ``n`` bytes. Never via float
    division, which rounds wrongly past 2**53."""
    return -(-n // d)


def format_bytes(num_bytes: int, digits: int = 4) -> str:
    """``num_bytes`` in the largest binary unit it fills: ``2 GiB``, ``13.0385 GiB``, ``512 B``.

    At most ``digits`` decimals, trailing zeros trimmed. Always binary units (KiB/MiB/GiB/TiB).
    """
    sign = "-" if num_bytes < 0 else ""
    size = abs(num_bytes)
    for unit, scale in _BINARY:
        if size >= scale:
            text = f"{size / scale:.{digits}f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
    return f"{sign}{size} B"


def describe_bytes(num_bytes: int) -> str:
    """Exact bytes plus the binary reading: ``2147483648 B (2 GiB)``."""
    if abs(num_bytes) < KiB:
        return f"{num_bytes} B"
    return f"{num_bytes} B ({format_bytes(num_bytes)})"
