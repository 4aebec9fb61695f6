"""Sizes and counts as people write them: ``32GB``, ``1.5TiB``, ``175B`` parameters.

[Note: decimal and binary units]
``KB/MB/GB/TB/PB`` are decimal (powers of 1000) and ``KiB/MiB/GiB/TiB/PiB`` binary (powers of
1024), as the SI and IEC standards define them. Hardware is sold and the ZeRO-Infinity paper
counts in decimal units (a DGX-2 has "1.5 TB" of host memory, a 1T-parameter model needs
"16 TB" of model states), so output is decimal by default; ``binary=True`` prints the units an
operating system reports for RAM. Unit letters are case-insensitive because nobody means
millibytes. Parameter counts use the suffixes of model names (``K``, ``M``, ``B``, ``T``).
"""

from __future__ import annotations

import math
import re

from outcore.errors import ConfigError

__all__ = ["format_bytes", "format_count", "parse_count", "parse_size"]

_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1, **_DECIMAL, **_BINARY}
_COUNT_UNITS: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?\s*"
                     r"(?P<unit>[a-zA-Z]*)\s*$")

SIZE_FORMS = "an integer number of bytes or a number with a unit: B, KB, MB, GB, TB, PB " \
             "(powers of 1000) or KiB, MiB, GiB, TiB, PiB (powers of 1024), e.g. 32GB, 1.5TB"
COUNT_FORMS = "an integer or a number with a suffix K, M, B or T, e.g. 1300000, 1.3B, 1T"


def _parse(text: str | int, units: dict[str, int], what: str, forms: str) -> int:
    """Shared parser: a non-negative number, optional exponent, optional unit from ``units``."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} {text!r} is not valid; use {forms}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} {text!r} is negative; use {forms}")
        return text
    match = _NUMBER.match(str(text))
    unit = match["unit"].lower() if match else ""
    if match is None or unit not in units:
        raise ConfigError(f"{what} {text!r} is not understood; use {forms}")
    try:
        value = float(match["num"]) * 10.0 ** int(match["exp"] or 0) * units[unit]
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ConfigError(f"{what} {text!r} is too large; use {forms}")
    if unit in ("", "b") and value != int(value):
        raise ConfigError(f"{what} {text!r} is not a whole number; use {forms}")
    return int(round(value))


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"32GB"``, ``"1.5TB"``, ``"24 GiB"`` or ``"4096"``.

    Raises ``ConfigError`` naming the value and the accepted forms, so the CLI can print it as
    its one-line error (see [Note: decimal and binary units]).
    """
    return _parse(text, _SIZE_UNITS, "size", SIZE_FORMS)


def parse_count(text: str | int) -> int:
    """A count, such as of parameters: ``"175B"``, ``"1.3b"``, ``"7e9"`` or ``"125000000"``."""
    return _parse(text, _COUNT_UNITS, "count", COUNT_FORMS)


def _scaled(n: float, steps: list[tuple[float, str]], sep: str) -> str:
    """``n`` divided by the largest step not above it, with three significant figures."""
    for factor, suffix in steps:
        if abs(n) >= factor:
            x = n / factor
            digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
            return f"{x:.{digits}f}{sep}{suffix}"
    raise AssertionError("callers handle values below the smallest step")


def format_bytes(n: float, *, binary: bool = False) -> str:
    """A byte count for people: ``16.0 TB`` (decimal) or ``24.0 GiB`` with ``binary=True``."""
    if binary:
        steps = [(2.0**50, "PiB"), (2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"),
                 (2.0**10, "KiB")]
    else:
        steps = [(1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")]
    if abs(n) < steps[-1][0]:
        return f"{n:.0f} B"
    return _scaled(n, steps, " ")


def format_count(n: float) -> str:
    """A parameter count as model names write it: ``124M``, ``1.75T``, ``950``."""
    if abs(n) < 1000:
        return f"{n:.0f}"
    return _scaled(n, [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")], "")
