"""units: exact parsing of sizes and counts, and printing with units (GB = 10^9, GiB = 2^30)."""

import pytest

from kvfleet.allocator.units import (
    GB,
    GiB,
    KiB,
    MiB,
    UnitError,
    describe_bytes,
    format_bytes,
    parse_count,
    parse_size,
)


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30),
    ("80GB", 80 * 10**9),
    ("25769803776", 25769803776),
    ("1.5 GiB", 1610612736),
    ("512MiB", 512 * 2**20),
    ("2gib", 2 * 2**30),
    ("4KiB", 4096),
    ("100B", 100),
    ("1e3", 1000),
])
def test_parse_size_is_exact(text, expected):
    assert parse_size(text) == expected


def test_gb_and_gib_differ():
    assert parse_size("24GB") == 24_000_000_000 != parse_size("24GiB") == 25_769_803_776


@pytest.mark.parametrize("text", ["24G", "24 gigs", "", "-1GB", "GB", "1.0000000001B", "1e-3"])
def test_parse_size_refuses_ambiguous_or_malformed(text):
    with pytest.raises(UnitError, match="^--memory: "):
        parse_size(text, "--memory")


@pytest.mark.parametrize("text, expected", [
    ("7e9", 7_000_000_000),
    ("7B", 7_000_000_000),
    ("7b", 7_000_000_000),
    ("405B", 405_000_000_000),
    ("1.5B", 1_500_000_000),
    ("70M", 70_000_000),
    ("7000000000", 7_000_000_000),
])
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["7X", "seven", "0.5"])
def test_parse_count_refuses(text):
    with pytest.raises(UnitError, match="^--params: "):
        parse_count(text, "--params")


def test_unit_constants():
    assert (KiB, MiB, GiB, GB) == (1024, 2**20, 2**30, 10**9)


@pytest.mark.parametrize("n, text", [
    (2 * GiB, "2 GiB"),
    (14 * GB, "13.0385 GiB"),
    (307200, "300 KiB"),
    (70272, "68.625 KiB"),
    (512, "512 B"),
    (0, "0 B"),
    (-3 * MiB, "-3 MiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_describe_bytes_keeps_exact_count():
    assert describe_bytes(2 * GiB) == "2147483648 B (2 GiB)"
    assert describe_bytes(1008) == "1008 B"


def test_cdiv_is_exact_where_float_ceil_is_not() -> None:
    from kvfleet.allocator.units import cdiv

    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    big = 2**53 + 1  # float(big) rounds down to 2**53: math.ceil(big / 1) would be off by one
    assert cdiv(big, 1) == big and cdiv(big, 2) == 2**52 + 1
