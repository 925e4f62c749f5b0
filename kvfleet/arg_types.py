"""argparse types of the ``kvfleet`` commands and the router's: a bad value is a usage error naming
the flag."""

from __future__ import annotations

import argparse
from typing import Callable


def non_empty(flag: str) -> Callable[[str], str]:
    """argparse type: a string that is not empty or only whitespace (else a usage error)."""
    def check(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{flag} must not be empty")
        return value
    return check


def positive_int(flag: str) -> Callable[[str], int]:
    """argparse type: an integer >= 1 (else a usage error naming ``flag``)."""
    def check(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {value!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {n}")
        return n
    return check


def int_in_range(flag: str, least: int, most: int) -> Callable[[str], int]:
    """argparse type: an integer in [``least``, ``most``] (else a usage error naming ``flag``)."""
    def check(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {value!r}") from None
        if not least <= n <= most:
            raise argparse.ArgumentTypeError(f"{flag} must be in [{least}, {most}], got {n}")
        return n
    return check


def even_int(flag: str, least: int = 2) -> Callable[[str], int]:
    """argparse type: an even integer >= ``least`` (else a usage error naming ``flag``)."""
    def check(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {value!r}") from None
        if n < least or n % 2:
            raise argparse.ArgumentTypeError(f"{flag} must be an even integer >= {least}, got {n}")
        return n
    return check


def _number(value: str, what: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a number, got {value!r}") from None


def _positive_number(value: str, what: str) -> float:
    x = _number(value, what)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{what} must be > 0, got {value}")
    return x


def positive_float(flag: str) -> Callable[[str], float]:
    """argparse type: a finite number > 0 (else a usage error naming ``flag``)."""
    return lambda value: _positive_number(value, flag)


def non_negative_float(flag: str) -> Callable[[str], float]:
    """argparse type: a finite number >= 0 (else a usage error naming ``flag``)."""
    def check(value: str) -> float:
        x = _number(value, flag)
        if not 0 <= x < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {value}")
        return x
    return check


def fraction(flag: str) -> Callable[[str], float]:
    """argparse type: a number in (0, 1] (else a usage error naming ``flag``)."""
    def check(value: str) -> float:
        x = _number(value, flag)
        if not 0 < x <= 1:
            raise argparse.ArgumentTypeError(f"{flag} must be in (0, 1], got {value}")
        return x
    return check


def priority_admit(value: str) -> dict[str, float]:
    """argparse type of ``--priority-admit`` (kvfleet.priority.parse_admit), a usage error
    naming the flag when malformed."""
    from kvfleet.priority import parse_admit

    try:
        return parse_admit(value, "--priority-admit")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_seconds(value: str) -> float:
    """argparse type: a finite number of seconds > 0 (a deadline already past is a usage error)."""
    return _positive_number(value, "seconds")


def int_range(flag: str) -> Callable[[str], tuple[int, int]]:
    """argparse type: ``MIN..MAX`` as a pair of integers (else a usage error naming ``flag``;
    their order is checked where they are used)."""
    def check(value: str) -> tuple[int, int]:
        lo, sep, hi = value.partition("..")
        try:
            if not sep:
                raise ValueError(value)
            return int(lo), int(hi)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes MIN..MAX (e.g. 1..4), "
                                             f"got {value!r}") from None
    return check
