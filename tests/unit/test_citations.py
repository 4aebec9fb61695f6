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
    """The headings of ``results`` (a RESULTS.md) and the first cell of each table row,
    outside its fenced blocks (whose ``#`` lines are comments of commands)."""
    names, fenced = [], False
    for line in results.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            continue
        elif line.startswith("#"):
            names.append(line.lstrip("#").strip())
        elif line.startswith("|"):
            names.append(line.split("|")[1].strip())
    return [re.sub(r"\s+", " ", n) for n in names]


def stale_records(text: str) -> list[str]:
    """The records ``text`` cites that are not in bench/results/."""
    return sorted(n for n in set(RECORD.findall(text)) if not (RECORDS / n).is_file())


def stale_rows(text: str, names: list[str]) -> list[str]:
    """The words ``text`` quotes from RESULTS.md that name none of its rows (``names``)."""
    return sorted(w for w in set(QUOTED.findall(text)) if not any(w in n for n in names))


def test_every_cited_record_exists() -> None:
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in _cited_in() for name in stale_records(_read(path))]
    assert not missing, "records cited but not in bench/results/:\n" + "\n".join(missing)


def test_every_quoted_results_row_is_there() -> None:
    names = row_names((ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8"))
    missing = [f"{path.relative_to(ROOT)}: {words!r}"
               for path in _cited_in() for words in stale_rows(_read(path), names)]
    assert not missing, "words quoted from bench/RESULTS.md but not in it:\n" + "\n".join(missing)


def test_the_checks_find_stale_citations() -> None:
    """The checks can fail: a note citing a record that does not exist and words no row has,
    over a line break of a docstring or a comment, with an apostrophe inside the words."""
    note = _flat("(measured: bench/results/2026-11-22-intel-amx-bf16-training-host-path.md,\n"
                 "    2026-01-01-no-such-record.md; bench/RESULTS.md, 'I/O engine\n"
                 "    vs fio')\n    # see bench/RESULTS.md, 'the I/O pool's idle\n    # pages')")
    assert stale_records(note) == ["2026-01-01-no-such-record.md"]
    names = row_names("| what | result |\n|---|---|\n| I/O engine vs fio, sequential | 1.1x |\n")
    assert stale_rows(note, names) == ["the I/O pool's idle pages"]


def test_a_row_is_named_by_its_first_cell_or_heading() -> None:
    """Words in a result, a link or a fenced command's comment do not name a row."""
    results = ("## Machines\n| what | result | record |\n|---|---|---|\n"
               "| I/O engine vs fio, sequential | 1.1x, with the update pipeline "
               "| [update pipeline](results/x.md) |\n```bash\n# Z6 the update pipeline\n```\n")
    names = row_names(results)
    assert any("Machines" in n for n in names)
    assert any("I/O engine vs fio" in n for n in names)
    assert not any("update pipeline" in n for n in names)
