"""Every measurement the code's notes and the docs cite can be found.

The ``[Note: …]`` blocks give their reasons with "(measured: …)" and point at a benchmark
record by file name, or at a row or section of ``bench/RESULTS.md`` by its words. The
headline page is rewritten as results are superseded, and records are added, so a citation
can go stale without anyone noticing: these checks fail on a record that does not exist
and on quoted words that ``bench/RESULTS.md`` no longer contains.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "bench" / "results"

pytestmark = pytest.mark.cpu_only("reads the sources and docs; the device changes nothing")

# a record's file name (dated, kebab-case), with or without its folder before it
RECORD = re.compile(r"\b(20\d\d-\d\d-\d\d-[a-z0-9][a-z0-9.-]*?\.md)\b")
# bench/RESULTS.md, 'the words of a row or heading'
QUOTED = re.compile(r"bench/RESULTS\.md, '([^']+)'")


def _cited_in() -> list[Path]:
    return sorted([*(ROOT / "outcore").rglob("*.py"), *(ROOT / "docs").rglob("*.md"),
                   ROOT / "README.md"])


def _flat(path: Path) -> str:
    """The file's text with every run of whitespace as one space, so a citation broken
    over two lines of a docstring reads as one."""
    return re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))


def records_cited(text: str) -> set[str]:
    return set(RECORD.findall(text))


def rows_cited(text: str) -> set[str]:
    return set(QUOTED.findall(text))


def test_every_cited_record_exists() -> None:
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in _cited_in() for name in sorted(records_cited(_flat(path)))
               if not (RECORDS / name).is_file()]
    assert not missing, "records cited but not in bench/results/:\n" + "\n".join(missing)


def test_every_quoted_results_row_is_there() -> None:
    results = re.sub(r"\s+", " ", (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8"))
    missing = [f"{path.relative_to(ROOT)}: {words!r}"
               for path in _cited_in() for words in sorted(rows_cited(_flat(path)))
               if words not in results]
    assert not missing, "words quoted from bench/RESULTS.md but not in it:\n" + "\n".join(missing)


def test_the_patterns_find_citations() -> None:
    """The checks can fail: both patterns find what a note writes, over a line break too."""
    note = ("(measured: bench/results/2026-11-22-intel-amx-bf16-training-host-path.md,\n"
            "    2026-11-28-amd-zen5-bf16-offload-cpu.md; bench/RESULTS.md, 'update\n"
            "    pipeline')")
    flat = re.sub(r"\s+", " ", note)
    assert records_cited(flat) == {"2026-11-22-intel-amx-bf16-training-host-path.md",
                                   "2026-11-28-amd-zen5-bf16-offload-cpu.md"}
    assert rows_cited(flat) == {"update pipeline"}
    assert not (RECORDS / "2026-01-01-no-such-record.md").exists()
