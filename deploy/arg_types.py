"""argparse types of the ``kvfleet`` commands: a bad value is a usage error naming the flag."""

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


def positive_seconds(value: str) -> float:
    """argparse type: a finite number of seconds > 0 (a deadline already past is a usage error)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value}")
    return seconds


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
