"""Every measurement the code's notes and the docs cite can be found.

The ``[Note: …]`` blocks give their reasons with "(measured: …)" and point at a benchmark
record by file name, or at a row or section of ``bench/RESULTS.md`` by its words. The
headline page is rewritten as results are superseded, and records are added, so a citation
can go stale without anyone noticing: these checks fail on a record that does not exist
and on quoted words that no heading and no row's first cell of ``bench/RESULTS.md`` holds
any more (words found only in a result, a link or a command do not name a row).
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
# bench/RESULTS.md, 'the words of a row or heading' (an apostrophe inside a word, as in
# "pool's", belongs to the words)
QUOTED = re.compile(r"bench/RESULTS\.md, '((?:[^']|'(?=[a-z]))+)'")


def _cited_in() -> list[Path]:
    return sorted([*(ROOT / "outcore").rglob("*.py"), *(ROOT / "docs").rglob("*.md"),
                   ROOT / "README.md"])


def _flat(text: str) -> str:
    """``text`` with every run of whitespace as one space, so a citation broken over two
    lines of a docstring or of a ``#`` comment reads as one."""
    return re.sub(r"\s+", " ", re.sub(r"\n\s*#+", " ", text))


def _read(path: Path) -> str:
    return _flat(path.read_text(encoding="utf-8"))


def row_names(results: str) -> list[str]:
    """The headings of ``results`` (a RESULTS.md) and the first cell of each table row."""
    names = []
    for line in results.splitlines():
        if line.startswith("#"):
            names.append(line.lstrip("#").strip())
        elif line.startswith("|"):
            names.append(line.split("|")[1].strip())
    return [re.sub(r"\s+", " ", n) for n in names]


def records_cited(text: str) -> set[str]:
    return set(RECORD.findall(text))


def rows_cited(text: str) -> set[str]:
    return set(QUOTED.findall(text))


def test_every_cited_record_exists() -> None:
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in _cited_in() for name in sorted(records_cited(_read(path)))
               if not (RECORDS / name).is_file()]
    assert not missing, "records cited but not in bench/results/:\n" + "\n".join(missing)


def test_every_quoted_results_row_is_there() -> None:
    names = row_names((ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8"))
    missing = [f"{path.relative_to(ROOT)}: {words!r}"
               for path in _cited_in() for words in sorted(rows_cited(_read(path)))
               if not any(words in name for name in names)]
    assert not missing, "words quoted from bench/RESULTS.md but not in it:\n" + "\n".join(missing)


def test_the_patterns_find_citations() -> None:
    """The checks can fail: both patterns find what a note writes, over a line break of a
    docstring or a comment, with an apostrophe inside the quoted words."""
    note = ("(measured: bench/results/2026-11-22-intel-amx-bf16-training-host-path.md,\n"
            "    2026-11-28-amd-zen5-bf16-offload-cpu.md; bench/RESULTS.md, 'update\n"
            "    pipeline')\n    # see bench/RESULTS.md, 'the I/O pool's idle\n    # pages')")
    flat = _flat(note)
    assert records_cited(flat) == {"2026-11-22-intel-amx-bf16-training-host-path.md",
                                   "2026-11-28-amd-zen5-bf16-offload-cpu.md"}
    assert rows_cited(flat) == {"update pipeline", "the I/O pool's idle pages"}
    assert not (RECORDS / "2026-01-01-no-such-record.md").exists()


def test_a_row_is_named_by_its_first_cell_or_heading() -> None:
    """Words in a result, a link or a command do not name a row."""
    results = ("## Machines\n| what | result | record |\n|---|---|---|\n"
               "| I/O engine vs fio, sequential | 1.1x, with the update pipeline "
               "| [update pipeline](results/x.md) |\n")
    names = row_names(results)
    assert any("Machines" in n for n in names)
    assert any("I/O engine vs fio" in n for n in names)
    assert not any("update pipeline" in n for n in names)
