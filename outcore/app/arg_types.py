"""argparse types for the ``outcore`` command's numbers: sizes with units, counts, whole
numbers. A value they refuse is an ``ArgumentTypeError`` whose text argparse shows as the one
line of cli.py's [Note: the CLI error policy]."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from outcore.errors import ConfigError
from outcore.units import parse_count, parse_size


def size(text: str) -> int:
    """A size with units (``32GB``, ``512MiB``)."""
    return _parsed(parse_size, text)


def probe_size(text: str) -> int:
    """At least 64 MiB: a smaller round times the disk's latency and cache, not its rate
    (``--size 1`` measured one 4 KiB page at 0.01 GB/s, which ``estimate`` then trusted)."""
    value = size(text)
    if value < 64 * 2**20:
        raise argparse.ArgumentTypeError(f"size {text!r} is under 64MiB, too small to measure "
                                         "a disk's rate")
    return value


def count(text: str) -> int:
    """A count with a suffix (``1.3B``, ``13.1M``)."""
    return _parsed(parse_count, text)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _parsed(parse: Callable[[str], int], text: str) -> int:
    """``parse(text)``, its ``ConfigError`` as the ``ArgumentTypeError`` whose own text
    argparse shows."""
    try:
        return parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
