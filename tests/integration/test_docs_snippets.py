"""Every ```python block in README.md and docs/*.md runs as a user who copies it would run it.

Each block is written to a file and run with this checkout's outcore in a fresh interpreter,
its working folder a new temporary one, so a block can rely on nothing but itself: no
earlier block's variables, no files it did not write. The docs keep their real-looking NVMe
paths; where a block names ``/mnt/nvme`` or ``/local_nvme``, the run uses a folder of that
name inside its temporary folder instead (created beforehand, as a mounted disk would be).
After the block exits, outcore must have removed every swap file it wrote.

A block that is deliberately not runnable (a fragment of a larger program, or one that needs
a model download or a GPU) is preceded by ``<!-- snippet: skip — reason -->``, on the line
before its fence. Every skip must give its reason; each skipped block is reported as a
skipped test case with that reason (``pytest -ra`` lists them), so the list is never hidden.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^`]*$")
SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\b(?P<rest>.*?)-->\s*$")
SKIP_REASON = re.compile(r"^\s*[—:-]+\s*(?P<reason>\S.*?)\s*$")
# Paths the docs name as a user's disk, and where a run puts them inside its folder.
MOUNTS = ("/mnt/nvme", "/local_nvme")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int                   # 1-based line of the opening fence
    code: str
    skip: str | None            # the reason, for a block marked not runnable

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def parse(page: Path) -> tuple[list[Snippet], list[str]]:
    """The page's python blocks, and the problems found in its skip markers."""
    lines = page.read_text(encoding="utf-8").splitlines()
    snippets: list[Snippet] = []
    problems: list[str] = []
    markers: dict[int, str | None] = {}   # line index of a marker -> its reason (None: none)
    i = 0
    while i < len(lines):
        skip = SKIP.match(lines[i])
        if skip:
            reason = SKIP_REASON.match(skip.group("rest"))
            markers[i] = reason.group("reason") if reason else None
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = fence.group("indent"), i
        i += 1
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[i]):
            i += 1
        if fence.group("lang") not in ("python", "py"):
            i += 1
            continue
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[start + 1:i]]
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        skip_reason = None
        if prev in markers:
            skip_reason = markers.pop(prev)
            if skip_reason is None:
                problems.append(f"{page.name}:{prev + 1}: a snippet skip without its reason; "
                                "write <!-- snippet: skip — why it cannot run -->")
                skip_reason = "(no reason given)"
        snippets.append(Snippet(page, start + 1, "\n".join(body) + "\n", skip_reason))
        i += 1
    problems += [f"{page.name}:{line + 1}: a snippet skip marker that precedes no python block"
                 for line in markers]
    return snippets, problems


SNIPPETS = [s for page in PAGES for s in parse(page)[0]]


def test_docs_hold_python_blocks_and_every_skip_says_why() -> None:
    """The parser finds the blocks (a broken one would make every test below vacuous), and
    every skip marker gives a reason and sits right above a python block."""
    assert len(SNIPPETS) >= 15, [s.name for s in SNIPPETS]
    assert {s.page.name for s in SNIPPETS} >= {"README.md", "python.md", "checkpoints.md"}
    problems = [p for page in PAGES for p in parse(page)[1]]
    assert not problems, "\n".join(problems)
    runnable = [s for s in SNIPPETS if s.skip is None]
    assert len(runnable) >= len(SNIPPETS) / 2, "most blocks should run as they are written"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    if env.get("OUTCORE_DEVICE", "cpu") != "cuda":   # the suite's device (tests/conftest.py)
        env.update(OUTCORE_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    return env


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.skip is not None:
        pytest.skip(f"{snippet.name}: not runnable by design: {snippet.skip}")
    code = snippet.code
    for mount in MOUNTS:
        local = tmp_path / mount.lstrip("/")
        (local / "swap").mkdir(parents=True)
        code = code.replace(mount, local.as_posix())
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (
        f"{snippet.name} exited {proc.returncode}\n--- code ---\n{code}\n--- output ---\n"
        f"{(proc.stdout + proc.stderr)[-6000:]}")
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.swap"))
    assert not left, f"{snippet.name} left swap files behind: {left}"
