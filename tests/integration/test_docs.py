"""The documentation site builds, its generated pages follow the code, and the README stays short.

One ``mkdocs build --strict`` (any warning, such as a broken link or anchor, fails it) feeds
every check on the built pages. The configuration reference and the notes index are generated
at build time by ``docs/hooks/outcore_docs.py``; these tests read the code independently and
check the built HTML against it.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from outcore.config import Config
from tests.common import REPO

ROOT = REPO

# The README's quick start: outside checks run exactly these two commands.
QUICK_START = [
    "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e . "
    "&& .venv/bin/outcore train",
    "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[test]' "
    "&& .venv/bin/python -m pytest -q -n 2 --dist loadfile",
]

# A note is defined where a line starts with "[Note: title]" (after indentation and an
# optional "#") and ends there or goes on with a sentence; "x.py's [Note: ...]" cites one.
NOTE_DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\](?:\s+[A-Z`].*)?\s*$")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _rows(page: Path) -> list[list[str]]:
    """Each table row of a built page as its cells' plain text."""
    text = page.read_text(encoding="utf-8")
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", text, re.S):
        cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)
        rows.append([html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells])
    return rows


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def test_site_builds_with_every_page(site: Path) -> None:
    for page in ("index", "getting-started", "python", "cli", "offload", "overlap",
                 "checkpoints", "huggingface", "configuration", "reliability", "design",
                 "benchmarks"):
        built = site / "index.html" if page == "index" else site / page / "index.html"
        assert built.is_file(), f"docs page {page} was not built"
    assert not (site / "hooks").exists(), "the build hook must not be published as a page"


def test_configuration_page_lists_every_key_with_its_default(site: Path) -> None:
    page = site / "configuration" / "index.html"
    rows = {cells[0]: cells for cells in _rows(page) if cells}
    fields = list(_leaf_fields(Config))
    assert len(fields) > 20
    for key, field in fields:
        assert key in rows, f"configuration page lacks key {key}"
        default = field.get_default(call_default_factory=True)
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        assert shown in rows[key][2], f"{key}: default {shown} not in {rows[key]}"
    text = page.read_text(encoding="utf-8")
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            assert f"<code>{name}</code>" in text, f"no section for {name}"


def test_notes_index_lists_every_note(site: Path) -> None:
    notes = []
    for path in sorted((ROOT / "outcore").rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = NOTE_DEFINITION.match(line)
            if m:
                notes.append((m.group(1).replace("`", ""), path.relative_to(ROOT).as_posix()))
    assert len(notes) > 50
    rows = [cells for cells in _rows(site / "design" / "index.html")
            if len(cells) == 3 and cells[1].startswith("outcore/")]
    listed = [(cells[0], cells[1].rsplit(":", 1)[0]) for cells in rows]
    missing = [n for n in notes if n not in listed]
    assert not missing, f"notes missing from the index: {missing}"
    assert len(listed) == len(notes), "the index lists entries that are not note definitions"


def test_benchmarks_page_shows_an_efficiency_curve_per_cpu_kind(site: Path) -> None:
    """The performance page shows the efficiency against tokens per step for each CPU kind
    measured, as figures shipped with the site (a missing file would show nothing)."""
    page = site / "benchmarks" / "index.html"
    shown = {}
    for tag in re.findall(r"<img[^>]*>", page.read_text(encoding="utf-8")):
        src, alt = re.search(r'src="([^"]+)"', tag), re.search(r'alt="([^"]*)"', tag)
        assert src and alt and alt.group(1), f"an image without a source or a description: {tag}"
        assert (page.parent / src.group(1)).resolve().is_file(), f"{src.group(1)} not in the site"
        shown[html.unescape(alt.group(1))] = src.group(1)
    for kind in ("Intel AMX", "AMD EPYC"):
        assert any(kind in alt and "Efficiency" in alt for alt in shown), (kind, shown)


def test_readme_is_a_short_front_page_with_the_quick_start_unchanged() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    section = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README has no '## Quick start' section"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section.group(1), re.S | re.M)
    assert len(blocks) == 1, "the quick start must hold exactly one fenced block"
    commands = [line for line in blocks[0].splitlines() if line.strip()]
    assert commands == QUICK_START


def test_readme_links_into_the_docs_resolve(site: Path) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)", text)
    assert len(links) >= 8, "the README should link its features into docs/"
    for target, anchor in links:
        assert (ROOT / target).is_file(), f"README links to missing {target}"
        if anchor:
            name = Path(target).stem
            built = site / "index.html" if name == "index" else site / name / "index.html"
            assert f'id="{anchor}"' in built.read_text(encoding="utf-8"), \
                f"README links to missing anchor {target}#{anchor}"
