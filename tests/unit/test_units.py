"""Sizes and counts as people type them, and back."""

from __future__ import annotations

import pytest

from outcore.errors import ConfigError
from outcore.units import format_bytes, format_count, parse_count, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("32GB", 32 * 10**9),
    ("32gb", 32 * 10**9),
    ("1.5TB", 1_500_000_000_000),
    ("28 TB", 28 * 10**12),
    ("24GiB", 24 * 2**30),
    ("24 gib", 24 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1KB", 1000),
    ("1KiB", 1024),
    ("2TiB", 2 * 2**40),
    ("4096", 4096),
    ("4096B", 4096),
    ("0", 0),
    (".5KB", 500),
    ("1e3KB", 10**6),
    (7, 7),
])
def test_parse_size_accepts_decimal_binary_and_plain_forms(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["32XB", "", "GB", "-1GB", "1.5", "1.5B", "12 G B", "1e999TB",
                                 "ten GB", -5])
def test_parse_size_rejects_with_config_error_naming_value_and_forms(bad: str | int) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(bad)
    message = str(err.value)
    assert repr(bad) in message  # names the value
    assert "GB" in message and "GiB" in message  # and the accepted forms
    assert isinstance(err.value, ValueError)


def test_parse_count_uses_model_name_suffixes() -> None:
    assert parse_count("175B") == 175 * 10**9
    assert parse_count("1.3b") == 1_300_000_000
    assert parse_count("1T") == 10**12
    assert parse_count("7e9") == 7 * 10**9
    assert parse_count("125M") == 125 * 10**6
    assert parse_count("1000") == 1000
    with pytest.raises(ConfigError, match="'12 parameters'"):
        parse_count("12 parameters")


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (999, "999 B"), (1000, "1.00 KB"), (1_500_000_000_000, "1.50 TB"),
    (16 * 10**12, "16.0 TB"), (512 * 10**9, "512 GB"), (2 * 10**15, "2.00 PB"),
])
def test_format_bytes_is_decimal_with_three_significant_figures(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_binary() -> None:
    assert format_bytes(2**30, binary=True) == "1.00 GiB"
    assert format_bytes(24 * 2**30, binary=True) == "24.0 GiB"
    assert format_bytes(100, binary=True) == "100 B"


@pytest.mark.parametrize("n", [1, 4095, 10**6 + 7, 3 * 2**30, 28 * 10**12, 1.7e15])
def test_format_then_parse_round_trips_within_rounding(n: float) -> None:
    for binary in (False, True):
        back = parse_size(format_bytes(n, binary=binary).replace(" ", ""))
        assert back == pytest.approx(n, rel=0.005)


def test_format_count() -> None:
    assert format_count(124_439_808) == "124M"
    assert format_count(1.75e12) == "1.75T"
    assert format_count(1_400_000_000) == "1.40B"
    assert format_count(950) == "950"
    assert format_count(0) == "0"
